"""Harness models and datasets: real parsers on small files written here, shapes, counts, messages.

The full Fashion-MNIST test runs only where the Debian package dataset-fashion-mnist is installed.
"""
import builtins
import gzip
import pickle
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradzip.harness import data as data_module
from gradzip.harness import DATASETS, MODELS, DataNotFoundError, DatasetInfo, build_model, load_dataset, task_of
from gradzip.harness.data import read_idx
from gradzip.harness.models import model_options

IDX_TYPES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def write_idx(path, array, gz):
    array = np.asarray(array)
    header = bytes([0, 0, IDX_TYPES[array.dtype.type], array.ndim]) + np.array(array.shape, ">u4").tobytes()
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def write_mnist_like(directory, split, images, labels, gz=True):
    ext = ".gz" if gz else ""
    write_idx(directory / f"{split}-images-idx3-ubyte{ext}", images, gz)
    write_idx(directory / f"{split}-labels-idx1-ubyte{ext}", labels, gz)


def one_line_error(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def count(model):
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------ IDX files


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
@pytest.mark.parametrize("dtype", list(IDX_TYPES))
def test_read_idx_round_trip(tmp_path, gz, dtype):
    array = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5)
    if dtype is np.uint8:
        array = np.arange(30, dtype=np.uint8).reshape(2, 3, 5) * 8
    write_idx(tmp_path / "a.idx", array, gz)
    out = read_idx(tmp_path / "a.idx")
    assert out.shape == (2, 3, 5) and np.array_equal(out, array)


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", np.zeros((4, 2, 2), np.uint8), gz=False)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(ValueError, match="13 data bytes"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
@pytest.mark.parametrize("name, mean, std", [("fashion-mnist", 0.2860, 0.3530), ("mnist", 0.1307, 0.3081)])
def test_idx_datasets_shapes_and_normalisation(tmp_path, gz, name, mean, std):
    images = np.zeros((5, 28, 28), np.uint8)
    images[:, 0, 0] = 255
    write_mnist_like(tmp_path, "train", images, np.array([0, 1, 2, 3, 9], np.uint8), gz)
    write_mnist_like(tmp_path, "t10k", images[:2], np.array([4, 5], np.uint8), gz)
    train, info = load_dataset(name, data_dir=tmp_path)
    test, _ = load_dataset(name, data_dir=str(tmp_path), train=False)
    assert info == DatasetInfo(name, (1, 28, 28), 10, "classification")
    x, y = train.tensors
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert y.tolist() == [0, 1, 2, 3, 9] and y.dtype == torch.int64
    assert x[0, 0, 1, 1].item() == pytest.approx((0 - mean) / std)
    assert x[0, 0, 0, 0].item() == pytest.approx((1 - mean) / std)
    assert len(test) == 2 and test.tensors[1].tolist() == [4, 5]


def test_idx_images_and_labels_must_match(tmp_path):
    write_mnist_like(tmp_path, "train", np.zeros((3, 28, 28), np.uint8), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="do not match"):
        load_dataset("mnist", data_dir=tmp_path)


def test_missing_idx_data_says_where_and_how(tmp_path, monkeypatch):
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("fashion-mnist", data_dir=tmp_path)
    one_line_error(excinfo, "Fashion-MNIST", str(tmp_path), "train-images-idx3-ubyte.gz", "--data-dir")
    assert isinstance(excinfo.value, FileNotFoundError)

    monkeypatch.setattr(data_module, "FASHION_MNIST_DIR", tmp_path / "nowhere")
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("fashion-mnist", train=False)
    one_line_error(excinfo, str(tmp_path / "nowhere"), "t10k-labels-idx1-ubyte.gz",
                   "apt-get install dataset-fashion-mnist", "--data-dir")

    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("mnist")
    one_line_error(excinfo, "MNIST", "train-images-idx3-ubyte.gz", "--data-dir")

    # Images without labels is still missing data.
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((1, 28, 28), np.uint8), gz=False)
    with pytest.raises(DataNotFoundError, match="train-labels-idx1-ubyte"):
        load_dataset("mnist", data_dir=tmp_path)


# ------------------------------------------------------------------------------------------ CIFAR-10


def write_cifar(directory, per_batch=2):
    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        pixels = np.zeros((per_batch, 3, 32, 32), np.uint8)
        pixels[:, 1] = 255  # green channel full, others zero
        batch = {b"data": pixels.reshape(per_batch, 3072), b"labels": [i] * per_batch, b"batch_label": name.encode()}
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "cifar-10-batches-py"])
def test_cifar10_shapes_and_per_channel_normalisation(tmp_path, nested):
    write_cifar(tmp_path / "cifar-10-batches-py" if nested else tmp_path)
    train, info = load_dataset("cifar10", data_dir=tmp_path)
    test, _ = load_dataset("cifar10", data_dir=tmp_path, train=False)
    assert info == DatasetInfo("cifar10", (3, 32, 32), 10, "classification")
    x, y = train.tensors
    assert x.shape == (10, 3, 32, 32) and x.dtype == torch.float32
    assert y.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert x[3, 0, 5, 7].item() == pytest.approx(-0.4914 / 0.2470)
    assert x[3, 1, 5, 7].item() == pytest.approx((1 - 0.4822) / 0.2435)
    assert x[3, 2, 5, 7].item() == pytest.approx(-0.4465 / 0.2616)
    assert len(test) == 2 and test.tensors[1].tolist() == [5, 5]


def test_missing_cifar10_says_where_and_how(tmp_path):
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("cifar10")
    one_line_error(excinfo, "CIFAR-10", "data_batch_1", "--data-dir")
    write_cifar(tmp_path)
    (tmp_path / "data_batch_4").unlink()
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("cifar10", data_dir=tmp_path)
    one_line_error(excinfo, str(tmp_path), "data_batch_4", "--data-dir")
    assert len(load_dataset("cifar10", data_dir=tmp_path, train=False)[0]) == 2  # test_batch is there


# ---------------------------------------------------------------------------------------------- text

CORPUS = {
    "train.txt": " the cat sat on the mat \n the dog sat \n",
    "valid.txt": " the cat ran \n",
    "test.txt": " a dog sat on the zebra \n",
}


def write_corpus(directory, files=CORPUS):
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")


def test_text_vocabulary_and_windows(tmp_path):
    write_corpus(tmp_path)
    train, info = load_dataset("text", data_dir=tmp_path, seq_len=4)
    vocab = ["<eos>", "<unk>", "cat", "dog", "mat", "on", "sat", "the"]  # sorted, from train.txt only
    assert list(info.vocab) == vocab
    assert info == DatasetInfo("text", (4,), len(vocab), "language_model", tuple(vocab))
    words = "the cat sat on the mat <eos> the dog sat <eos>".split()
    tokens = [vocab.index(w) for w in words]  # 11 tokens: two windows of 4 (+1 target) fit
    x, y = train.tensors
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 4)
    assert x.tolist() == [tokens[0:4], tokens[4:8]]
    assert y.tolist() == [tokens[1:5], tokens[5:9]]


def test_text_test_split_maps_unknown_words_to_unk(tmp_path):
    write_corpus(tmp_path)
    test, info = load_dataset("text", data_dir=tmp_path, train=False, seq_len=3)
    words = [info.vocab[i] for i in torch.cat([test.tensors[0].flatten(), test.tensors[1][-1, -1:]])]
    assert words == "<unk> dog sat on the <unk> <eos>".split()  # "a" and "zebra" are not in train.txt


def test_text_test_split_falls_back_to_valid(tmp_path):
    write_corpus(tmp_path, {k: v for k, v in CORPUS.items() if k != "test.txt"})
    test, info = load_dataset("text", data_dir=tmp_path, train=False, seq_len=1)
    x, y = test.tensors
    assert [info.vocab[i] for i in [*x.flatten(), y[-1, -1]]] == "the cat <unk> <eos>".split()  # valid.txt


def test_text_accepts_ptb_file_names(tmp_path):
    write_corpus(tmp_path, {f"ptb.{k}": v for k, v in CORPUS.items()})
    assert len(load_dataset("text", data_dir=tmp_path, seq_len=5)[0]) == 2


def test_text_errors(tmp_path):
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("text")
    one_line_error(excinfo, "train.txt", "--data-dir")
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("text", data_dir=tmp_path)
    one_line_error(excinfo, str(tmp_path), "train.txt", "--data-dir")
    write_corpus(tmp_path, {"train.txt": CORPUS["train.txt"]})
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("text", data_dir=tmp_path, train=False)
    one_line_error(excinfo, "test.txt", "--data-dir")
    with pytest.raises(ValueError, match="too few"):
        load_dataset("text", data_dir=tmp_path, seq_len=11)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        load_dataset("text", data_dir=tmp_path, seq_len=0)


# --------------------------------------------------------------------------------------------- chars


def test_chars_from_a_data_dir_vocabulary_and_windows(tmp_path):
    write_corpus(tmp_path, {"train.txt": "abcab\ncé", "test.txt": "cab!a"})
    train, info = load_dataset("chars", data_dir=tmp_path, seq_len=3)
    vocab = ["\n", "a", "b", "c", "é", "<unk>"]  # sorted characters of train.txt, then the unknown id
    assert info == DatasetInfo("chars", (3,), len(vocab), "language_model", tuple(vocab))
    tokens = [vocab.index(c) for c in "abcab\ncé"]  # 8 characters: two windows of 3 (+1 target) fit
    x, y = train.tensors
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [tokens[0:3], tokens[3:6]] and y.tolist() == [tokens[1:4], tokens[4:7]]
    test, test_info = load_dataset("chars", data_dir=tmp_path, train=False, seq_len=2)
    assert test_info.vocab == info.vocab and test_info.input_shape == (2,)
    x, y = test.tensors
    assert "".join(vocab[i] for i in [*x.flatten(), y[-1, -1]]) == "cab<unk>a"  # "!" is not in train.txt


def test_chars_falls_back_to_valid_and_reports_what_is_missing(tmp_path):
    write_corpus(tmp_path, {"train.txt": "abcabc", "valid.txt": "cba"})
    test, info = load_dataset("chars", data_dir=tmp_path, train=False, seq_len=2)
    assert [info.vocab[i] for i in test.tensors[0].flatten()] == ["c", "b"]
    (tmp_path / "valid.txt").unlink()
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("chars", data_dir=tmp_path, train=False)
    one_line_error(excinfo, str(tmp_path), "test.txt (or valid.txt)", "--data-dir")
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("chars", data_dir=tmp_path / "nowhere")
    one_line_error(excinfo, "train.txt", "--data-dir")
    with pytest.raises(ValueError, match="too few for one window of seq_len=6"):
        load_dataset("chars", data_dir=tmp_path, seq_len=6)


def test_chars_reads_every_regular_file_of_the_default_folder_and_tests_on_the_last_tenth(tmp_path, monkeypatch):
    licenses = tmp_path / "licenses"
    licenses.mkdir()
    (licenses / "B").write_text("b" * 17 + "!bb")
    (licenses / "A").write_text("a" * 80 + "xyzw")
    (licenses / "LINK").symlink_to("A")  # Debian's GPL -> GPL-3: read once, not twice
    (licenses / "sub").mkdir()
    monkeypatch.setattr(data_module, "COMMON_LICENSES_DIR", licenses)
    train, info = load_dataset("chars", seq_len=9)
    test, _ = load_dataset("chars", train=False, seq_len=9)
    whole = "a" * 80 + "xyzw" + "b" * 17 + "!bb"  # A then B: 104 characters, the last 10 for test
    assert len(train) == (94 - 1) // 9 and len(test) == (10 - 1) // 9
    assert info.vocab == ("a", "b", "w", "x", "y", "z", "<unk>")  # "!" is only in the test part
    decode = lambda ids: "".join(info.vocab[i] for i in ids)  # noqa: E731
    assert decode(train.tensors[0].flatten()) == whole[: 9 * len(train)]
    assert decode(train.tensors[1][-1]) == whole[82:91]
    assert decode(test.tensors[0].flatten()) + decode(test.tensors[1][-1, -1:]) == "bbbbbbb<unk>bb"
    for child in (licenses / "B", licenses / "A", licenses / "LINK"):
        child.unlink()
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("chars")
    one_line_error(excinfo, str(licenses), "base-files", "--data-dir")


@pytest.mark.skipif(not data_module.COMMON_LICENSES_DIR.is_dir(), reason="not a Debian system (no base-files)")
def test_chars_on_debians_license_texts():
    train, info = load_dataset("chars", seq_len=64)
    test, _ = load_dataset("chars", train=False, seq_len=64)
    assert info.name == "chars" and info.input_shape == (64,) and info.vocab[-1] == "<unk>"
    assert 60 < info.num_classes < 120 and info.vocab.index(" ") < info.vocab.index("a")
    assert 8 * len(test) < len(train) < 10 * len(test)  # 90/10, in whole windows
    train_text = {"".join(info.vocab[i] for i in row) for row in train.tensors[0].tolist()}
    assert all("".join(info.vocab[i] for i in row) not in train_text for row in test.tensors[0].tolist())


def _docs_tree(root, version="3.11"):
    """A python3-doc-like tree: 12 documents, each a distinct letter repeated, in two folders."""
    sources = root / f"python{version}" / "html" / "_sources"
    for i in range(12):
        folder = sources / ("library" if i % 2 else "tutorial")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"doc{i:02d}.rst.txt").write_text(chr(ord("a") + i) * 40 + "\n")
    (sources / "library" / "link.rst.txt").symlink_to(sources / "library" / "doc01.rst.txt")
    (sources / "image.png").write_bytes(b"not text")
    return sources


def test_corpus_holds_out_whole_documents_and_is_deterministic(tmp_path, monkeypatch):
    sources = _docs_tree(tmp_path)
    _docs_tree(tmp_path, "3.9")  # an older version beside it: the newest is read
    monkeypatch.setattr(data_module, "PYTHON_DOCS_GLOB", str(tmp_path / "python3.*" / "html" / "_sources"))
    assert data_module.python_docs_dir() == sources
    train_docs, test_docs = data_module.corpus_documents(sources)
    names = lambda docs: [p.relative_to(sources).as_posix() for p in docs]  # noqa: E731
    # Sorted by path: library/doc01, 03, ..., 11, then tutorial/doc00, ..., 10; the 10th is held out.
    assert names(test_docs) == ["tutorial/doc06.rst.txt"]
    assert len(train_docs) == 11 and not set(train_docs) & set(test_docs)
    train, info = load_dataset("corpus", seq_len=8)
    test, _ = load_dataset("corpus", train=False, seq_len=8)
    text = "".join(p.read_text() for p in train_docs)
    assert len(text) == 11 * 41 and len(train) == (len(text) - 1) // 8
    # Every character of the train text occurs >= 1 time per 100,000: all of them, plus "<unk>".
    assert info.vocab == ("\n", *"abcdefhijkl", "<unk>") and info.num_classes == 13
    decode = lambda ids: "".join(info.vocab[i] for i in ids)  # noqa: E731
    assert decode(train.tensors[0].flatten()) == text[: 8 * len(train)]
    assert decode(train.tensors[1][0]) == text[1:9]
    # The test document's "g" is not in the train text: <unk>.  Its 5 windows come in a fixed shuffled order.
    assert len(test) == 5
    rows = sorted(decode(row) for row in test.tensors[0])
    assert rows == sorted(decode(row) for row in test.tensors[0][torch.arange(5)])
    assert set("".join(rows).replace("<unk>", "")) == set() and all(row == "<unk>" * 8 for row in rows)
    again, _ = load_dataset("corpus", train=False, seq_len=8)
    assert torch.equal(again.tensors[0], test.tensors[0]) and torch.equal(again.tensors[1], test.tensors[1])


def test_corpus_test_windows_are_a_fixed_permutation(tmp_path):
    (tmp_path / "train.txt").write_text("abcdefgh" * 5)
    (tmp_path / "test.txt").write_text("abcdefgh" * 5 + "Z")
    test, info = load_dataset("corpus", data_dir=tmp_path, train=False, seq_len=4)
    assert info.vocab == (*"abcdefgh", "<unk>")
    decode = lambda ids: "".join(info.vocab[i] for i in ids)  # noqa: E731
    order = np.random.RandomState(0).permutation(10)  # (41 - 1) // 4 windows
    whole = "abcdefgh" * 5
    assert [decode(row) for row in test.tensors[0]] == [whole[4 * i: 4 * i + 4] for i in order]
    assert decode(test.tensors[1][list(order).index(9)]) == "fgh<unk>"  # "Z" is not in the train text


def test_corpus_vocabulary_keeps_characters_seen_once_per_100000(tmp_path):
    (tmp_path / "train.txt").write_text("a" * 199_998 + "bb" + "c")  # 200,001 characters: keep 2 or more
    (tmp_path / "test.txt").write_text("ab\u00e9c")
    train, info = load_dataset("corpus", data_dir=tmp_path, seq_len=4)
    assert info.vocab == ("a", "b", "<unk>")  # c once: <unk>
    assert train.tensors[1][-1].tolist() == [0, 1, 1, 2]  # the last window ends "abbc"
    test, _ = load_dataset("corpus", data_dir=tmp_path, train=False, seq_len=3)
    assert test.tensors[0][0].tolist() == [0, 1, 2] and test.tensors[1][0].tolist() == [1, 2, 2]  # é and c


def test_corpus_missing_says_which_package(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "PYTHON_DOCS_GLOB", str(tmp_path / "python3.*" / "html" / "_sources"))
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("corpus")
    one_line_error(excinfo, "python3-doc", "--data-dir")
    with pytest.raises(DataNotFoundError) as excinfo:
        load_dataset("corpus", data_dir=tmp_path)
    one_line_error(excinfo, "train.txt", str(tmp_path))


def test_passes_over_data():
    assert data_module.passes_over_data(1000, 16, 2, 160_000) == 0.2
    assert data_module.passes_over_data(3, 5, 1, 15) == 1.0
    with pytest.raises(ValueError, match="train_samples must be >= 1"):
        data_module.passes_over_data(1, 1, 1, 0)


@pytest.mark.skipif(data_module.python_docs_dir() is None,
                    reason="the Python documentation is not installed (apt-get install python3-doc)")
def test_corpus_on_the_python_documentation():
    train, info = load_dataset("corpus", seq_len=64)
    test, _ = load_dataset("corpus", train=False, seq_len=64)
    train_docs, test_docs = data_module.corpus_documents(data_module.python_docs_dir())
    assert len(train) * 64 >= 5_000_000 and len(test) * 64 >= 500_000  # characters in whole windows
    assert not set(train_docs) & set(test_docs)
    assert len(test_docs) == len(train_docs + test_docs) // 10
    assert info.name == "corpus" and info.vocab[-1] == "<unk>" and 90 <= info.num_classes <= 110
    unk = info.num_classes - 1
    assert (train.tensors[0] == unk).float().mean() < 1e-3 and (test.tensors[0] == unk).float().mean() < 1e-3
    again, _ = load_dataset("corpus", seq_len=64)
    assert torch.equal(again.tensors[0], train.tensors[0]) and torch.equal(again.tensors[1], train.tensors[1])


# ------------------------------------------------------------------------------- digits and synthetic


def test_digits_split():
    pytest.importorskip("sklearn", reason="digits ships with scikit-learn, which is not installed")
    train, info = load_dataset("digits")
    test, _ = load_dataset("digits", train=False)
    assert info == DatasetInfo("digits", (1, 8, 8), 10, "classification")
    assert (len(train), len(test)) == (1437, 360)
    x = train.tensors[0]
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32 and x.min() == 0 and x.max() == 1
    again, _ = load_dataset("digits", seed=5)
    assert torch.equal(again.tensors[0], x)  # the split does not follow seed


def test_digits_are_load_digits_read_without_importing_scikit_learn(monkeypatch):
    """The table is scikit-learn's own, read from its file without importing scikit-learn (seconds of a
    core in every worker); where the file is not found, load_digits gives the same table."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    bunch = sklearn_datasets.load_digits()
    want = np.concatenate([bunch.data, bunch.target[:, None]], axis=1)
    imported, real_import = [], __import__

    def watched(name, *args, **kwargs):
        if name.partition(".")[0] == "sklearn":
            imported.append(name)
        return real_import(name, *args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", watched)
        table = data_module._digits_table()
    assert imported == [] and table.dtype == np.float64 and np.array_equal(table, want)
    monkeypatch.setattr(data_module.importlib.util, "find_spec", lambda name: None)  # the file is not found
    assert np.array_equal(data_module._digits_table(), want)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # and scikit-learn is not installed
    with pytest.raises(DataNotFoundError, match="ships with scikit-learn, which is not installed"):
        data_module._digits_table()


def test_synthetic_shapes_seeds_and_splits():
    train, info = load_dataset("synthetic", synthetic_shape=(3, 4, 5), synthetic_classes=7, synthetic_size=50)
    assert info == DatasetInfo("synthetic", (3, 4, 5), 7, "classification")
    x, y = train.tensors
    assert x.shape == (50, 3, 4, 5) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0 <= y.min() and y.max() < 7
    same, _ = load_dataset("synthetic", synthetic_shape=(3, 4, 5), synthetic_classes=7, synthetic_size=50)
    assert torch.equal(same.tensors[0], x) and torch.equal(same.tensors[1], y)
    test, _ = load_dataset("synthetic", synthetic_shape=(3, 4, 5), synthetic_classes=7, synthetic_size=50, train=False)
    other, _ = load_dataset("synthetic", synthetic_shape=(3, 4, 5), synthetic_classes=7, synthetic_size=50, seed=1)
    assert not torch.equal(test.tensors[0], x) and not torch.equal(other.tensors[0], x)


@pytest.mark.parametrize("shape", [(1, 28, 28), (20,)])
def test_synthetic_is_learnable(shape):
    train, info = load_dataset("synthetic", synthetic_shape=shape)
    test, _ = load_dataset("synthetic", synthetic_shape=shape, train=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(shape)), 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = train.tensors
    for _ in range(300):
        idx = torch.randint(0, len(x), (64,))
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    assert accuracy > 0.6  # chance is about 0.1-0.2 (the classes are not exactly balanced)


@pytest.mark.parametrize("kwargs, message", [
    ({"synthetic_shape": (1, 0)}, "synthetic_shape must be a non-empty tuple"),
    ({"synthetic_shape": ()}, "synthetic_shape must be a non-empty tuple"),
    ({"synthetic_shape": 28}, "synthetic_shape must be a non-empty tuple"),
    ({"synthetic_classes": 1}, "synthetic_classes must be an integer >= 2"),
    ({"synthetic_size": 0}, "synthetic_size must be an integer >= 1"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"train": "yes"}, "train must be True or False"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_dataset("synthetic", **kwargs)


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError) as excinfo:
        load_dataset("imagenet")
    one_line_error(excinfo, "'imagenet'", *DATASETS)


# -------------------------------------------------------------------------------------------- models


def info_for(shape, classes=10):
    return DatasetInfo("synthetic", shape, classes, "classification")


TEXT_INFO = DatasetInfo("text", (35,), 10000, "language_model")


def test_parameter_counts():
    assert count(build_model("cnn", info_for((1, 28, 28)))) == 1_199_882  # the PyTorch MNIST example
    assert count(build_model("resnet20", info_for((3, 32, 32)))) == 269_722  # "0.27M" (He et al. Table 6)
    assert count(build_model("resnet20", info_for((3, 32, 32)), shortcut="B")) == 272_474
    assert count(build_model("mlp", info_for((1, 28, 28)))) == 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    lstm = build_model("lstm", TEXT_INFO)
    assert count(lstm) == 10000 * 200 + 2 * 4 * (200 * 200 + 200 * 200 + 2 * 200) + 10000
    assert lstm.embedding.weight.numel() / count(lstm) > 0.7  # embedding-heavy on purpose


def test_cnn_flatten_size_follows_input():
    assert build_model("cnn", info_for((1, 28, 28))).fc1.in_features == 9216
    assert build_model("cnn", info_for((3, 32, 32))).fc1.in_features == 64 * 14 * 14
    assert build_model("cnn", info_for((1, 8, 8))).fc1.in_features == 64 * 2 * 2
    assert build_model("cnn", info_for((2, 9, 12))).fc1.in_features == 64 * 2 * 4


DATA_FOR_MODELS = [
    ("cnn", {"synthetic_shape": (1, 28, 28)}),
    ("cnn", {"synthetic_shape": (3, 32, 32)}),
    ("cnn", {"synthetic_shape": (1, 8, 8)}),
    ("mlp", {"synthetic_shape": (1, 28, 28)}),
    ("mlp", {"synthetic_shape": (17,)}),
    ("resnet20", {"synthetic_shape": (3, 32, 32)}),
    ("resnet20", {"synthetic_shape": (1, 28, 28)}),
    ("resnet20", {"synthetic_shape": (1, 8, 8)}),
]


@pytest.mark.parametrize("name, kwargs", DATA_FOR_MODELS)
def test_classifier_forward_and_every_parameter_gets_a_gradient(name, kwargs):
    dataset, info = load_dataset("synthetic", synthetic_classes=5, synthetic_size=4, **kwargs)
    torch.manual_seed(0)
    model = build_model(name, info)
    x, y = dataset.tensors
    logits = model(x)
    assert logits.shape == (4, 5)
    F.cross_entropy(logits, y).backward()
    # An unused parameter would need find_unused_parameters in DDP and skew compression statistics.
    assert all(p.grad is not None for p in model.parameters())


def test_lstm_forward_on_text(tmp_path):
    write_corpus(tmp_path)
    dataset, info = load_dataset("text", data_dir=tmp_path, seq_len=3)
    torch.manual_seed(0)
    model = build_model("lstm", info, emb=16, hidden=16)
    x, y = dataset.tensors
    logits = model(x)
    assert logits.shape == (len(x), 3, info.num_classes)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_lstm_weight_tying():
    tied = build_model("lstm", TEXT_INFO, emb=32, hidden=32)
    assert tied.tied and tied.decoder.weight is tied.embedding.weight
    assert sum(1 for _ in tied.parameters()) == len(list(tied.state_dict())) - 1  # one Parameter, two names
    untied = build_model("lstm", TEXT_INFO, emb=32, hidden=48)
    assert not untied.tied and untied.decoder.weight is not untied.embedding.weight
    assert untied(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 10000)
    assert not build_model("lstm", TEXT_INFO, emb=32, hidden=32, tie=False).tied
    with pytest.raises(ValueError, match="tie=True needs emb == hidden"):
        build_model("lstm", TEXT_INFO, emb=32, hidden=48, tie=True)


def test_lstm_dropout_only_in_training():
    torch.manual_seed(0)
    model = build_model("lstm", TEXT_INFO, emb=16, hidden=16, dropout=0.5).eval()
    x = torch.randint(0, 10000, (2, 6))
    assert torch.equal(model(x), model(x))


def test_model_registry_and_errors():
    assert set(MODELS) == {"cnn", "mlp", "resnet20", "lstm", "gpt"}
    assert [task_of(m) for m in MODELS] == ["language_model" if m in ("lstm", "gpt") else "classification"
                                            for m in MODELS]
    assert model_options("lstm") == {"emb": 200, "hidden": 200, "layers": 2, "dropout": 0.0, "tie": None}
    with pytest.raises(ValueError) as excinfo:
        build_model("vgg16", info_for((3, 32, 32)))
    one_line_error(excinfo, "'vgg16'", *MODELS)
    with pytest.raises(ValueError) as excinfo:
        task_of("bert")
    one_line_error(excinfo, *MODELS)
    with pytest.raises(ValueError) as excinfo:
        build_model("cnn", info_for((3, 32, 32)), width=2)
    one_line_error(excinfo, "width", "none")
    with pytest.raises(ValueError) as excinfo:
        build_model("cnn", TEXT_INFO)
    one_line_error(excinfo, "'cnn'", "classification", "language_model", "lstm, gpt")
    with pytest.raises(ValueError) as excinfo:
        build_model("lstm", info_for((1, 28, 28)))
    one_line_error(excinfo, "'lstm'", "cnn", "mlp", "resnet20")
    with pytest.raises(ValueError, match="C x H x W"):
        build_model("cnn", info_for((784,)))
    with pytest.raises(ValueError, match="H, W >= 6"):
        build_model("cnn", info_for((1, 5, 28)))
    with pytest.raises(ValueError, match="shortcut must be 'A'"):
        build_model("resnet20", info_for((3, 32, 32)), shortcut="C")
    with pytest.raises(ValueError, match="dropout must be"):
        build_model("lstm", TEXT_INFO, dropout=1.0)


# ---------------------------------------------------------------------------------- real Fashion-MNIST


@pytest.mark.skipif(data_module._idx_pair(data_module.FASHION_MNIST_DIR, "train") is None,
                    reason="Fashion-MNIST not installed in /usr/share/datasets/fashion-mnist "
                           "(apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist():
    start = time.perf_counter()
    train, info = load_dataset("fashion-mnist")
    elapsed = time.perf_counter() - start
    test, _ = load_dataset("fashion-mnist", train=False)
    assert (len(train), len(test)) == (60000, 10000)
    assert info == DatasetInfo("fashion-mnist", (1, 28, 28), 10, "classification")
    x, y = train.tensors
    assert x.shape == (60000, 1, 28, 28) and x.dtype == torch.float32
    assert y.bincount().tolist() == [6000] * 10
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01  # the usual mean/std are right
    assert test.tensors[1].bincount().tolist() == [1000] * 10
    assert elapsed < 10  # about 1 s; a per-pixel Python loop would take minutes
    with torch.no_grad():
        assert build_model("cnn", info).eval()(x[:8]).shape == (8, 10)

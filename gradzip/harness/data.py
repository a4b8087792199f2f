"""Datasets for the experiment harness: ``DATASETS`` lists the names, ``load_dataset(name)`` loads one.

Everything is read from local files (or generated) into memory as a ``TensorDataset``; nothing is
downloaded and nothing is cached on disk.  A missing dataset raises :class:`DataNotFoundError` with a
one-line message saying which files were expected where and how to provide them.
"""
from __future__ import annotations

import gzip
import importlib.util
import math
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian package dataset-fashion-mnist
COMMON_LICENSES_DIR = Path("/usr/share/common-licenses")  # Debian package base-files
# Debian package python3-doc (python3.X-doc): the reStructuredText sources of the Python documentation that
# Sphinx copies beside the HTML, about 11 MB of English in 500 documents (3.11 on Debian 12).
PYTHON_DOCS_GLOB = "/usr/share/doc/python3.*/html/_sources"
CORPUS_TEST_EVERY = 10  # the corpus holds out every 10th document (sorted by path) as its test split
DATASETS = ("fashion-mnist", "mnist", "digits", "cifar10", "text", "chars", "corpus", "synthetic")
TASKS = ("classification", "language_model")

PathLike = Union[str, os.PathLike]


class DataNotFoundError(FileNotFoundError):
    """A dataset's files are not where they were looked for; the message says how to fix it."""


@dataclass
class DatasetInfo:
    """What a model needs to know about a dataset.

    ``input_shape`` is one sample's shape (``(seq_len,)`` for text); ``num_classes`` is the number of
    labels, or the vocabulary size for a language model; ``vocab`` (text, chars, corpus) maps ids to tokens.
    """

    name: str
    input_shape: tuple
    num_classes: int
    task: str
    vocab: Optional[tuple] = field(default=None, repr=False)


# ---------------------------------------------------------------------------------------------- IDX

# IDX type byte -> big-endian numpy dtype (yann.lecun.com/exdb/mnist, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: PathLike) -> np.ndarray:
    """Parse an IDX file (gzip-compressed or plain; detected from the content, not the name).

    Header: two zero bytes, a type byte, the number of dimensions, then one big-endian uint32 per
    dimension; the data follows in C order.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex() or 'none'})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path} is truncated: its header declares {ndim} dimensions")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path} holds {len(raw) - header} data bytes, its header {dims} says {expected}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims)


def _idx_pair(directory: Path, split: str) -> Optional[tuple[Path, Path]]:
    found = []
    for kind, ndim in (("images", 3), ("labels", 1)):
        # The usual names, gzipped or not; some mirrors write "train-images.idx3-ubyte" instead.
        names = [f"{split}-{kind}-idx{ndim}-ubyte{ext}" for ext in (".gz", "")]
        names += [f"{split}-{kind}.idx{ndim}-ubyte{ext}" for ext in (".gz", "")]
        path = next((directory / n for n in names if (directory / n).is_file()), None)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def _load_idx_images(title: str, directory: Path, train: bool, mean: float, std: float, fix: str):
    split = "train" if train else "t10k"
    paths = _idx_pair(directory, split)
    if paths is None:
        raise DataNotFoundError(
            f"{title} not found in {directory} (expected {split}-images-idx3-ubyte.gz and "
            f"{split}-labels-idx1-ubyte.gz, or the same without .gz): {fix}"
        )
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{paths[0]} and {paths[1]} do not match: images {images.shape}, labels {labels.shape}")
    x = torch.from_numpy(images.astype(np.float32)).unsqueeze(1)
    x.div_(255.0).sub_(mean).div_(std)
    return x, torch.from_numpy(labels.astype(np.int64))


# --------------------------------------------------------------------------------------- the loaders


def _fashion_mnist(data_dir: Optional[Path], train: bool):
    if data_dir is None:
        directory, fix = FASHION_MNIST_DIR, "install it with `apt-get install dataset-fashion-mnist` or pass --data-dir DIR"
    else:
        directory, fix = data_dir, "pass --data-dir pointing at the folder that holds these files"
    # Mean and std of the 60000 training images (as used by torchvision's Fashion-MNIST examples).
    x, y = _load_idx_images("Fashion-MNIST", directory, train, 0.2860, 0.3530, fix)
    return x, y, DatasetInfo("fashion-mnist", tuple(x.shape[1:]), 10, "classification")


def _mnist(data_dir: Optional[Path], train: bool):
    fix = "pass --data-dir pointing at the folder that holds the MNIST IDX files"
    if data_dir is None:
        raise DataNotFoundError(
            f"MNIST has no default location (expected train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            f"t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz): {fix}"
        )
    x, y = _load_idx_images("MNIST", data_dir, train, 0.1307, 0.3081, fix)
    return x, y, DatasetInfo("mnist", tuple(x.shape[1:]), 10, "classification")


def _digits_table() -> np.ndarray:
    """scikit-learn's ``digits.csv.gz`` (64 pixels and the label a row), read the way ``load_digits``
    reads it, but found without importing scikit-learn: that import (scipy's included) costs seconds of
    a core in every worker that trains on digits, against milliseconds for the file."""
    spec = importlib.util.find_spec("sklearn")
    places = spec.submodule_search_locations if spec is not None else None
    for place in places or ():
        path = Path(place) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return np.loadtxt(f, delimiter=",")
    try:  # a scikit-learn that keeps the file elsewhere
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataNotFoundError(
            "the digits dataset ships with scikit-learn, which is not installed: `pip install scikit-learn`"
        ) from None
    bunch = load_digits()
    return np.concatenate([bunch.data, bunch.target[:, None]], axis=1)


def _digits(train: bool):
    """scikit-learn's 8x8 digits (1797 images shipped inside the package), split 80/20.

    The split is a fixed permutation (RandomState(0), stable across numpy versions), independent of
    ``seed``, so train and test never overlap whatever seeds a run uses.
    """
    table = _digits_table()
    images, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    order = np.random.RandomState(0).permutation(len(target))
    cut = int(0.8 * len(order))
    keep = order[:cut] if train else order[cut:]
    x = torch.from_numpy(images[keep].astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(target[keep].astype(np.int64))
    return x, y, DatasetInfo("digits", (1, 8, 8), 10, "classification")


CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _cifar10(data_dir: Optional[Path], train: bool):
    """The "python version" of CIFAR-10 (www.cs.toronto.edu/~kriz/cifar.html): pickled dicts.

    The batches are pickles, and unpickling runs code: only point ``data_dir`` at files you trust.
    """
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    fix = "pass --data-dir pointing at the extracted cifar-10-batches-py folder (or its parent)"
    if data_dir is None:
        raise DataNotFoundError(f"CIFAR-10 has no default location (expected {', '.join(names)}): {fix}")
    directory = next((d for d in (data_dir, data_dir / "cifar-10-batches-py") if (d / names[0]).is_file()), None)
    if directory is None or any(not (directory / n).is_file() for n in names):
        raise DataNotFoundError(
            f"CIFAR-10 not found in {data_dir} or {data_dir / 'cifar-10-batches-py'} (expected {', '.join(names)}): {fix}"
        )
    images, labels = [], []
    for n in names:
        with open(directory / n, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    x = torch.from_numpy(np.concatenate(images).astype(np.float32)).div_(255.0)
    x.sub_(torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)).div_(torch.tensor(CIFAR10_STD).view(1, 3, 1, 1))
    y = torch.from_numpy(np.concatenate(labels))
    if len(x) != len(y):
        raise ValueError(f"CIFAR-10 in {directory}: {len(x)} images but {len(y)} labels")
    return x, y, DatasetInfo("cifar10", (3, 32, 32), 10, "classification")


def _text_file(directory: Path, split: str) -> Optional[Path]:
    # train.txt as in pytorch/examples' word_language_model; ptb.train.txt as in Mikolov's PTB archive.
    return next((directory / n for n in (f"{split}.txt", f"ptb.{split}.txt") if (directory / n).is_file()), None)


def _corpus_files(data_dir: Path, train: bool, title: str, fix: str) -> tuple[Path, Path]:
    """(train file, file of the requested split): test.txt, or valid.txt when the corpus has no test.txt."""
    train_path = _text_file(data_dir, "train")
    split_path = train_path if train else (_text_file(data_dir, "test") or _text_file(data_dir, "valid"))
    if train_path is None or split_path is None:
        missing = "train.txt" if train_path is None else "test.txt (or valid.txt)"
        raise DataNotFoundError(f"{title} not found in {data_dir} (expected {missing}): {fix}")
    return train_path, split_path


def _windows(tokens: Sequence[str], ids: dict, unk: int, seq_len: int, source) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive non-overlapping windows: x = tokens[i : i+seq_len], y = tokens[i+1 : i+seq_len+1]."""
    encoded = torch.tensor([ids.get(t, unk) for t in tokens], dtype=torch.int64)
    n = (len(encoded) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{source} has {len(encoded)} tokens, too few for one window of seq_len={seq_len} (+1)")
    return encoded[: n * seq_len].view(n, seq_len), encoded[1 : n * seq_len + 1].view(n, seq_len)


def _words(path: Path) -> list[str]:
    # One "<eos>" per line, as in pytorch/examples' word_language_model (data.py).
    with open(path, encoding="utf-8") as f:
        return [w for line in f for w in (*line.split(), "<eos>")]


def _text(data_dir: Optional[Path], train: bool, seq_len: int):
    """Word-level corpus in the PTB layout: train.txt, valid.txt, test.txt (or ptb.train.txt, ...).

    The vocabulary is every word of train.txt plus "<eos>" and "<unk>", sorted (ids do not depend on
    word order in the file); words of the test split outside it become "<unk>".  ``train=False`` reads
    test.txt, or valid.txt when the corpus has no test.txt.  Samples are consecutive non-overlapping
    windows: x = tokens[i : i+seq_len], y = tokens[i+1 : i+seq_len+1].
    """
    fix = "pass --data-dir pointing at a folder with train.txt, valid.txt and test.txt (e.g. the PTB data)"
    if data_dir is None:
        raise DataNotFoundError(f"the text dataset has no default location (expected train.txt and test.txt): {fix}")
    train_path, split_path = _corpus_files(data_dir, train, "text corpus", fix)
    train_words = _words(train_path)
    vocab = tuple(sorted(set(train_words) | {"<eos>", "<unk>"}))
    ids = {w: i for i, w in enumerate(vocab)}
    words = train_words if split_path == train_path else _words(split_path)
    x, y = _windows(words, ids, ids["<unk>"], seq_len, split_path)
    return x, y, DatasetInfo("text", (seq_len,), len(vocab), "language_model", vocab)


def _chars(data_dir: Optional[Path], train: bool, seq_len: int):
    """Character-level text: the license texts Debian ships by default, or train.txt/test.txt of ``data_dir``.

    Without ``data_dir`` it reads every regular file of /usr/share/common-licenses (package base-files,
    on every Debian system; about 240 KB of English), sorted by name and concatenated, and keeps the
    last 10% of the characters as the test split.  Links are skipped: GPL, LGPL and GFDL link to files
    that are read anyway, and a second copy could put test text into the train split.  With
    ``data_dir`` it reads train.txt and test.txt (or valid.txt), any UTF-8 text.  The vocabulary is the
    sorted characters of the train text plus "<unk>" (the last id), which test characters outside it
    become.  Samples are windows as in the ``text`` dataset.
    """
    if data_dir is None:
        files = sorted(p for p in COMMON_LICENSES_DIR.glob("*") if p.is_file() and not p.is_symlink())
        if not files:
            raise DataNotFoundError(
                f"no text files in {COMMON_LICENSES_DIR} (the chars dataset's default): install it with "
                f"`apt-get install base-files` or pass --data-dir DIR with train.txt and test.txt"
            )
        whole = "".join(p.read_text(encoding="utf-8") for p in files)
        cut = len(whole) - len(whole) // 10
        train_text, split_text, source = whole[:cut], whole[cut:], COMMON_LICENSES_DIR
    else:
        fix = "pass --data-dir pointing at a folder with train.txt and test.txt (any UTF-8 text)"
        train_path, split_path = _corpus_files(data_dir, train, "chars corpus", fix)
        train_text = train_path.read_text(encoding="utf-8")
        split_text = train_text if split_path == train_path else split_path.read_text(encoding="utf-8")
        source = split_path
    vocab = (*sorted(set(train_text)), "<unk>")
    ids = {c: i for i, c in enumerate(vocab[:-1])}
    x, y = _windows(train_text if train else split_text, ids, len(vocab) - 1, seq_len, source)
    return x, y, DatasetInfo("chars", (seq_len,), len(vocab), "language_model", vocab)


def python_docs_dir() -> Optional[Path]:
    """The newest Python version's documentation sources under /usr/share/doc (None: python3-doc missing)."""
    found = [p for p in Path("/").glob(PYTHON_DOCS_GLOB.lstrip("/")) if p.is_dir()]

    def version(path: Path) -> tuple:
        minor = path.parent.parent.name.partition(".")[2]
        return (int(minor) if minor.isdigit() else -1, path.name)

    return max(found, key=version, default=None)


def corpus_documents(directory: Path) -> tuple[list[Path], list[Path]]:
    """(train documents, test documents) of a folder of documentation sources: every regular ``*.txt`` file
    below it (links skipped, as in ``chars``), sorted by relative path; every ``CORPUS_TEST_EVERY``-th one
    (the 10th, 20th, ...) is held out for test, so no test character comes from a document trained on."""
    files = sorted((p for p in directory.rglob("*.txt") if p.is_file() and not p.is_symlink()),
                   key=lambda p: p.relative_to(directory).as_posix())
    test = set(files[CORPUS_TEST_EVERY - 1::CORPUS_TEST_EVERY])
    return [p for p in files if p not in test], [p for p in files if p in test]


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def _corpus_vocab(train_codes: np.ndarray) -> np.ndarray:
    """The characters (sorted code points) that occur at least once per 100,000 characters of the train text."""
    counts = np.bincount(train_codes)
    return np.flatnonzero(counts >= max(1, len(train_codes) // 100_000)).astype(np.uint32)


def _encode(codes: np.ndarray, vocab: np.ndarray) -> torch.Tensor:
    """Ids of the code points: their index in ``vocab``, or ``len(vocab)`` (the "<unk>" id) outside it."""
    table = np.full(max(int(codes.max(initial=0)), int(vocab.max(initial=0))) + 1, len(vocab), dtype=np.int64)
    table[vocab] = np.arange(len(vocab))
    return torch.from_numpy(table[codes])


def _corpus_texts(data_dir: Optional[Path]) -> tuple[str, str, object]:
    """(train text, test text, where the test text came from) of the corpus dataset."""
    if data_dir is not None:
        fix = "pass --data-dir pointing at a folder with train.txt and test.txt (any UTF-8 text)"
        train_path, test_path = _corpus_files(data_dir, False, "corpus", fix)
        return train_path.read_text(encoding="utf-8"), test_path.read_text(encoding="utf-8"), test_path
    directory = python_docs_dir()
    train_files, test_files = corpus_documents(directory) if directory else ([], [])
    if not test_files:
        raise DataNotFoundError(
            f"no Python documentation sources in {PYTHON_DOCS_GLOB} (the corpus dataset's default): install "
            f"them with `apt-get install python3-doc` or pass --data-dir DIR with train.txt and test.txt")
    read = lambda files: "".join(p.read_text(encoding="utf-8") for p in files)  # noqa: E731
    return read(train_files), read(test_files), directory


def _corpus(data_dir: Optional[Path], train: bool, seq_len: int):
    """Character-level English big enough not to repeat: the Python documentation's sources (python3-doc),
    or train.txt and test.txt (or valid.txt) of ``data_dir``.

    The default's test split is whole held-out documents (:func:`corpus_documents`).  The vocabulary is the
    characters that occur at least once per 100,000 characters of the train text, sorted, plus "<unk>" (the
    last id), which every other character of either split becomes.  Windows are as in ``text``, the same
    bytes giving the same windows; the test split's windows come in a fixed shuffled order
    (``RandomState(0)``), so that its first N windows (``test_size``) sample every test document.
    """
    train_text, test_text, source = _corpus_texts(data_dir)
    vocab_codes = _corpus_vocab(_codepoints(train_text))
    vocab = (*(chr(c) for c in vocab_codes), "<unk>")
    encoded = _encode(_codepoints(train_text if train else test_text), vocab_codes)
    n = (len(encoded) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{source} has {len(encoded)} characters, too few for one window of seq_len={seq_len} (+1)")
    x, y = encoded[: n * seq_len].view(n, seq_len), encoded[1: n * seq_len + 1].view(n, seq_len)
    if not train:
        order = torch.from_numpy(np.random.RandomState(0).permutation(n))
        x, y = x[order], y[order]
    return x, y, DatasetInfo("corpus", (seq_len,), len(vocab), "language_model", vocab)


def passes_over_data(steps: int, batch_size: int, workers: int, train_samples: int) -> float:
    """How many times a run went through its training data: samples drawn (``steps`` × ``batch_size`` per
    worker × ``workers``) over the training set's size.  For text, where a sample is a window of seq_len
    characters, that is steps × batch × workers × seq_len / the training characters."""
    if train_samples < 1:
        raise ValueError(f"train_samples must be >= 1, got {train_samples!r}")
    return steps * batch_size * workers / train_samples


def _synthetic(train: bool, shape: tuple, classes: int, size: int, seed: int):
    """Gaussian inputs labelled by a fixed random linear teacher: y = argmax(W^T x).

    The classes are linearly separable, so any model can learn them.  So that a few thousand samples
    also *generalise* (an isotropic teacher in 784 dimensions would need far more), x = (B^T z + e) / sqrt(2)
    with z a 16-dimensional Gaussian latent, e isotropic noise, and W = B^T V: still Gaussian inputs and a
    linear teacher in x, but the label depends on a 16-dimensional projection.  The teacher (B, V)
    depends on ``seed`` only; train and test inputs come from two other independent streams of that seed.
    """
    teacher_rng, train_rng, test_rng = (np.random.default_rng([seed, k]) for k in range(3))
    dim = math.prod(shape)
    latent = min(16, dim)
    basis = teacher_rng.standard_normal((latent, dim), dtype=np.float32) / math.sqrt(latent)
    directions = teacher_rng.standard_normal((latent, classes), dtype=np.float32)
    directions /= np.linalg.norm(directions, axis=0)  # equal norms keep the classes roughly balanced
    rng = train_rng if train else test_rng
    z = rng.standard_normal((size, latent), dtype=np.float32)
    x = (z @ basis + rng.standard_normal((size, dim), dtype=np.float32)) / math.sqrt(2)
    y = (x @ (basis.T @ directions)).argmax(1).astype(np.int64)
    return (torch.from_numpy(x).view(size, *shape), torch.from_numpy(y),
            DatasetInfo("synthetic", tuple(shape), classes, "classification"))


def _positive_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def load_dataset(name: str, *, data_dir: Optional[PathLike] = None, train: bool = True, seq_len: int = 35,
                 synthetic_shape: tuple = (1, 28, 28), synthetic_classes: int = 10, synthetic_size: int = 2048,
                 seed: int = 0) -> tuple[Dataset, DatasetInfo]:
    """Load the train (or test) split of dataset ``name`` as ``(TensorDataset(x, y), DatasetInfo)``.

    Images are float32 (N, C, H, W), normalised with the dataset's usual mean and std; labels int64.
    Text, chars and corpus give int64 windows x, y of shape (N, seq_len).  ``data_dir`` is where the files are
    (Fashion-MNIST defaults to /usr/share/datasets/fashion-mnist, chars to /usr/share/common-licenses,
    corpus to the Python documentation of python3-doc; mnist, cifar10 and text need it); ``seq_len``
    applies to text, chars and corpus; the ``synthetic_*`` options
    and ``seed`` to synthetic.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if not isinstance(train, bool):
        raise ValueError(f"train must be True or False, got {train!r}")
    seq_len = _positive_int("seq_len", seq_len)
    directory = None if data_dir is None else Path(data_dir).expanduser()
    if name == "fashion-mnist":
        x, y, info = _fashion_mnist(directory, train)
    elif name == "mnist":
        x, y, info = _mnist(directory, train)
    elif name == "digits":
        x, y, info = _digits(train)
    elif name == "cifar10":
        x, y, info = _cifar10(directory, train)
    elif name == "text":
        x, y, info = _text(directory, train, seq_len)
    elif name == "chars":
        x, y, info = _chars(directory, train, seq_len)
    elif name == "corpus":
        x, y, info = _corpus(directory, train, seq_len)
    else:
        shape = tuple(synthetic_shape) if isinstance(synthetic_shape, (tuple, list, torch.Size)) else ()
        if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
            raise ValueError(f"synthetic_shape must be a non-empty tuple of integers >= 1, got {synthetic_shape!r}")
        shape = tuple(int(d) for d in shape)
        classes = _positive_int("synthetic_classes", synthetic_classes, low=2)
        size = _positive_int("synthetic_size", synthetic_size)
        x, y, info = _synthetic(train, shape, classes, size, _positive_int("seed", seed, low=0))
    return TensorDataset(x, y), info


__all__ = ["DATASETS", "DataNotFoundError", "DatasetInfo", "load_dataset", "read_idx", "passes_over_data",
           "python_docs_dir", "corpus_documents"]

"""Models for the experiment harness: ``MODELS`` lists the names, ``build_model(name, info)`` builds one.

Every model returns raw scores (logits); the loss is ``cross_entropy`` in both tasks.  The models are
sized for CPU experiments, yet each keeps the layer mix that makes compression behave differently:
large fully connected layers (``cnn``, ``mlp``), many small conv and BatchNorm tensors (``resnet20``),
a huge embedding (``lstm``), and attention with many small LayerNorm and bias tensors (``gpt``).
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import torch.nn.functional as F
from torch import nn

from .data import DatasetInfo


def _image_shape(model: str, info: DatasetInfo, min_side: int) -> tuple[int, int, int]:
    shape = tuple(info.input_shape)
    if len(shape) != 3 or min(shape[1:]) < min_side:
        raise ValueError(
            f"model {model!r} needs C x H x W images with H, W >= {min_side}; "
            f"dataset {info.name!r} has input shape {shape}"
        )
    return shape


class MLP(nn.Module):
    """Flatten -> 256 -> 128 -> classes with ReLU: the smallest model with real matrix gradients."""

    def __init__(self, info: DatasetInfo, hidden: tuple[int, ...] = (256, 128)):
        super().__init__()
        if not hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
            raise ValueError(f"hidden must be a non-empty sequence of integers >= 1, got {hidden!r}")
        sizes = [math.prod(info.input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for n_in, n_out in zip(sizes, sizes[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], info.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class MnistCNN(nn.Module):
    """The CNN of the PyTorch MNIST example (github.com/pytorch/examples, mnist/main.py).

    conv 3x3 (C->32) - ReLU - conv 3x3 (32->64) - ReLU - max-pool 2 - dropout 0.25 - fc (->128) - ReLU -
    dropout 0.5 - fc (128->classes): 1.2M parameters on 1x28x28, 95% of them in the first fc layer, which
    is what makes it a good sparsification benchmark.  The fc input (9216 on 28x28) follows the image size.
    """

    def __init__(self, info: DatasetInfo):
        super().__init__()
        channels, height, width = _image_shape("cnn", info, min_side=6)
        self.conv1 = nn.Conv2d(channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        # Two unpadded 3x3 convs take 2 pixels off each side in total, then the pool halves (floor).
        self.fc1 = nn.Linear(64 * ((height - 4) // 2) * ((width - 4) // 2), 128)
        self.fc2 = nn.Linear(128, info.num_classes)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2)).flatten(1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus a shortcut (He et al., CVPR 2016, Fig. 2)."""

    def __init__(self, in_planes: int, planes: int, stride: int, shortcut: str):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride, self.extra = stride, planes - in_planes
        self.project = None
        if (stride != 1 or self.extra) and shortcut == "B":
            self.project = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def shortcut(self, x):
        if self.project is not None:
            return self.project(x)
        if self.stride != 1:
            # Option A: subsample like the stride-2 conv (ceil(H/2) rows either way) ...
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra:
            # ... and zero-pad the new channels, so the shortcut adds no parameters.
            x = F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
        return x

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He, Zhang, Ren & Sun, "Deep Residual Learning", CVPR 2016, Sec. 4.2).

    3x3 conv (16) then 3 stages of 3 basic blocks with 16/32/64 channels (stride 2 at the start of
    stages 2 and 3), global average pooling and one fc layer: 0.27M parameters.  ``shortcut="A"`` (the
    paper's CIFAR choice) uses parameter-free zero-padding shortcuts; ``"B"`` uses 1x1 conv projections
    where the shape changes.  Built for 3x32x32, it runs on any C x H x W (the pooling is adaptive).
    """

    def __init__(self, info: DatasetInfo, shortcut: str = "A", blocks_per_stage: int = 3):
        super().__init__()
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' (zero-padding) or 'B' (1x1 conv projection), got {shortcut!r}")
        if isinstance(blocks_per_stage, bool) or not isinstance(blocks_per_stage, int) or blocks_per_stage < 1:
            raise ValueError(f"blocks_per_stage must be an integer >= 1, got {blocks_per_stage!r}")
        channels = _image_shape("resnet20", info, min_side=1)[0]
        self.conv1 = nn.Conv2d(channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks_per_stage):
                stages.append(BasicBlock(in_planes, planes, stride if i == 0 else 1, shortcut))
                in_planes = planes
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(64, info.num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)  # He et al. 2015, as the paper does

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class LSTMLanguageModel(nn.Module):
    """Word-level LSTM language model (Zaremba, Sutskever & Vinyals 2014, "Recurrent Neural Network
    Regularization"; DGC, Lin et al. ICLR 2018, trains the same on PTB).

    embedding (vocab x emb) - dropout - LSTM (layers x hidden, dropout between layers) - dropout -
    linear (hidden -> vocab).  The defaults are Zaremba's small, unregularised config (2 x 200, no
    dropout), which trains on a CPU; their medium config is ``emb=hidden=650, dropout=0.5`` and their
    large one (the DGC setting) ``emb=hidden=1500, dropout=0.65``.  With ``tie=None`` the decoder reuses
    the embedding matrix whenever ``emb == hidden`` (Press & Wolf 2017; Inan et al. 2017).  On PTB's
    10k words the embedding is 2M of the 2.6M parameters: the tensor sparsification exists for.

    ``forward(x)`` takes token ids [batch, seq] and returns logits [batch, seq, vocab]; every call starts
    from a zero hidden state (each window of the dataset is an independent sample).
    """

    def __init__(self, info: DatasetInfo, emb: int = 200, hidden: int = 200, layers: int = 2,
                 dropout: float = 0.0, tie: Optional[bool] = None):
        super().__init__()
        for name, value in (("emb", emb), ("hidden", hidden), ("layers", layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a number with 0 <= dropout < 1, got {dropout!r}")
        if tie not in (None, True, False):
            raise ValueError(f"tie must be True, False or None (tie when emb == hidden), got {tie!r}")
        if tie and emb != hidden:
            raise ValueError(f"tie=True needs emb == hidden, got emb={emb}, hidden={hidden}")
        vocab = info.num_classes
        self.embedding = nn.Embedding(vocab, emb)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(emb, hidden, layers, dropout=dropout if layers > 1 else 0.0, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        # Zaremba et al. initialise every weight uniformly in [-0.1, 0.1] (small config) ...
        for p in self.parameters():
            nn.init.uniform_(p, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.tied = emb == hidden if tie is None else tie
        if self.tied:
            self.decoder.weight = self.embedding.weight  # ... and a tied pair is one Parameter

    def forward(self, x):
        out, _ = self.lstm(self.drop(self.embedding(x)))
        return self.decoder(self.drop(out))


class _Block(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2's order): x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer language model (GPT: Radford et al. 2018, "Improving Language
    Understanding by Generative Pre-Training"; GPT-2: Radford et al. 2019, "Language Models are
    Unsupervised Multitask Learners"), built from the Transformer (Vaswani et al., NeurIPS 2017).

    token + learned position embedding - dropout - ``layers`` pre-LayerNorm blocks of causal
    self-attention (``heads`` heads) and a GELU MLP (4 x width) - LayerNorm - linear (width -> vocab),
    whose weight is the token embedding when ``tie`` (as in GPT).  The context is the dataset's
    ``seq_len``.  Weights start as GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers).
    The defaults (0.4M parameters on ~100 characters) train on a CPU.  ``forward(x)`` takes token ids
    [batch, seq <= seq_len] and returns logits [batch, seq, vocab]; position t sees tokens 0..t only.
    """

    def __init__(self, info: DatasetInfo, layers: int = 2, width: int = 128, heads: int = 4,
                 dropout: float = 0.0, tie: bool = True):
        super().__init__()
        for name, value in (("layers", layers), ("width", width), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if width % heads:
            raise ValueError(f"width must be a multiple of heads, got width={width}, heads={heads}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a number with 0 <= dropout < 1, got {dropout!r}")
        if tie not in (True, False):
            raise ValueError(f"tie must be True or False, got {tie!r}")
        self.context = info.input_shape[0]
        self.tok, self.pos = nn.Embedding(info.num_classes, width), nn.Embedding(self.context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Block(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, info.num_classes, bias=False)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                # Each block adds its projections' outputs to the residual stream: scaled so that its
                # variance does not grow with depth (GPT-2, Sec. 2.3).
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
        self.tied = tie
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, x):
        if x.shape[1] > self.context:
            raise ValueError(f"sequence of {x.shape[1]} tokens is longer than the model's context {self.context}")
        h = self.drop(self.tok(x) + self.pos.weight[: x.shape[1]])
        return self.head(self.ln(self.blocks(h)))


_MODELS = {"cnn": MnistCNN, "mlp": MLP, "resnet20": ResNet20, "lstm": LSTMLanguageModel, "gpt": GPT}
_TASKS = {"cnn": "classification", "mlp": "classification", "resnet20": "classification", "lstm": "language_model",
          "gpt": "language_model"}
MODELS = tuple(_MODELS)


def task_of(name: str) -> str:
    """``"classification"`` or ``"language_model"``: which kind of dataset model ``name`` trains on."""
    if name not in _TASKS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}")
    return _TASKS[name]


def model_options(name: str) -> dict:
    """The options of model ``name`` (keyword arguments of :func:`build_model`) with their defaults."""
    task_of(name)
    params = list(inspect.signature(_MODELS[name].__init__).parameters.values())[2:]  # after self, info
    return {p.name: p.default for p in params}


def build_model(name: str, info: DatasetInfo, **options) -> nn.Module:
    """Build model ``name`` for the dataset described by ``info`` (input shape, classes or vocabulary).

    ``options`` go to the model (see :func:`model_options`), e.g. ``build_model("lstm", info, hidden=650,
    emb=650, dropout=0.5)``.  Seed the global RNG (``torch.manual_seed``) first for identical weights.
    """
    valid = model_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for model {name!r}; valid: {', '.join(valid) or 'none'}")
    if info.task != task_of(name):
        raise ValueError(
            f"model {name!r} is for {task_of(name)} data, but dataset {info.name!r} is {info.task}; "
            f"{info.task} models: {', '.join(m for m in MODELS if _TASKS[m] == info.task)}"
        )
    return _MODELS[name](info, **options)


__all__ = ["MODELS", "build_model", "model_options", "task_of"]

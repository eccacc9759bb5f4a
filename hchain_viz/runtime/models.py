"""Built-in demo models (torch only, CPU-friendly): each function returns ``(model, sample_input, loss_fn)``.

- :func:`resnet_chain` (the default demo): a small ResNet as an ``nn.Sequential`` of named stages — stem, residual
  blocks with downsampling, pooling, classifier. Activation sizes shrink several-fold along the chain and the stage
  times range from microseconds (flatten) to the convolution blocks, so optimal and uniform checkpointing differ.
- :func:`transformer_chain`: a GPT-style decoder (embedding, pre-LN blocks with dropout, head) as ``nn.Sequential``.
- :func:`mlp_chain`: dense layers of very different widths.
- :func:`hf_model`: a Hugging Face GPT-2, LLaMA, BERT or ViT from its *default* config (random weights, nothing
  downloaded), optionally shrunk, with a dict input that holds ``labels`` (the loss is the model's ``output.loss``).
- :func:`resnet_skip`: the same kind of ResNet written as an ordinary ``nn.Module`` with its own ``forward()`` and
  skip connections, laid out like torchvision's ResNet (``conv1, bn1, relu, maxpool, layer1.., avgpool, fc``).

``loss_fn(output) -> scalar`` closes over its targets (cross-entropy), so its gradient is a real tensor.
Building a model never disturbs the global RNG: weights and data come from ``seed`` inside a forked RNG.
Stages are built so that each one's input is saved by its own backward (conv, linear and norm layers first), as in
most real networks; a stage like a standalone ReLU would let eager PyTorch free its input early, which the chain
model (docs/design.md §3) does not describe.
"""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HChainError

__all__ = ["DEFAULT_DEMO", "DEMOS", "demo_model", "resnet_chain", "transformer_chain", "mlp_chain", "resnet_skip",
           "nanogpt", "HF_FAMILIES", "hf_model"]

Demo = tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]


# ---------------------------------------------------------------------------------------------- building blocks
class ConvBNReLU(nn.Module):
    """conv -> batch norm -> ReLU, one stage (the stem)."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions plus a skip connection (a 1x1 conv when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)  # in place on a block-private tensor: safe
        out = self.bn2(self.conv2(out))
        out = out + (x if self.downsample is None else self.downsample(x))
        return F.relu(out, inplace=True)


def _layers(width: int, blocks: tuple[int, ...]) -> list[tuple[str, nn.Sequential]]:
    """layer1..layerK: the first block of each layer after the first halves the resolution, doubles channels."""
    layers, c = [], width
    for k, n in enumerate(blocks):
        c_out = width * 2**k
        seq = [BasicBlock(c, c_out, stride=1 if k == 0 else 2)] + [BasicBlock(c_out, c_out) for _ in range(n - 1)]
        layers.append((f"layer{k + 1}", nn.Sequential(*seq)))
        c = c_out
    return layers


def _check_heads(dim: int, heads: int) -> None:
    if heads < 1 or dim % heads:
        raise HChainError(f"dim={dim} must be a multiple of heads={heads}; choose heads among the divisors of dim")


class CausalSelfAttentionBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head attention and an MLP, both residual, with dropout."""

    def __init__(self, dim: int, heads: int, seq: int, dropout: float):
        super().__init__()
        _check_heads(dim, heads)
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        att = self.drop(att.masked_fill(self.future[:T, :T], float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Embedding(nn.Module):
    """Token plus learned position embedding, with dropout."""

    def __init__(self, vocab: int, dim: int, seq: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(idx) + self.pos[: idx.shape[1]])


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class Dense(nn.Module):
    """Linear followed by ReLU, one stage."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class _CrossEntropy:
    """``loss_fn(output)``: cross-entropy against fixed class targets (logits of shape [..., classes])."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, -2), self.target.flatten())

    def __repr__(self) -> str:
        return f"cross_entropy(output, target of shape {tuple(self.target.shape)})"


def _seeded(seed: int, device: str | torch.device | None, build: Callable[[], Demo]) -> Demo:
    """Build inside a forked RNG seeded with ``seed`` (the caller's RNG is untouched), then move to ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, x, loss = build()
    if device is not None:
        model, x = model.to(device), x.to(device)
        loss.target = loss.target.to(device)
    return model, x, loss


# ---------------------------------------------------------------------------------------------- the demos
def resnet_chain(*, batch: int = 8, image: int = 64, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2, 2),
                 classes: int = 10, seed: int = 0, device: str | torch.device | None = None) -> Demo:
    """A ResNet for ``image`` x ``image`` RGB inputs as an ``nn.Sequential`` of named stages.

    Stages: ``stem`` (conv-bn-relu), ``layer1.0`` ... ``layerK.n`` (residual blocks; each layer after the first
    halves the resolution and doubles the channels), ``avgpool``, ``flatten``, ``fc``.
    """
    def build() -> Demo:
        model = nn.Sequential(OrderedDict(
            [("stem", ConvBNReLU(3, width))] + _layers(width, tuple(blocks))
            + [("avgpool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)),
               ("fc", nn.Linear(width * 2 ** (len(blocks) - 1), classes))]
        ))
        x = torch.randn(batch, 3, image, image)
        return model, x, _CrossEntropy(torch.randint(0, classes, (batch,)))

    return _seeded(seed, device, build)


def transformer_chain(*, batch: int = 8, seq: int = 64, dim: int = 128, heads: int = 4, layers: int = 4,
                      vocab: int = 128, dropout: float = 0.1, seed: int = 0,
                      device: str | torch.device | None = None) -> Demo:
    """A GPT-style decoder as an ``nn.Sequential``: ``embed``, ``blocks.0`` ... ``blocks.{layers-1}``, ``head``.

    The input is ``batch`` x ``seq`` token ids; the loss is next-token-style cross-entropy on random targets.
    """
    def build() -> Demo:
        model = nn.Sequential(OrderedDict([
            ("embed", Embedding(vocab, dim, seq, dropout)),
            ("blocks", nn.Sequential(*[CausalSelfAttentionBlock(dim, heads, seq, dropout) for _ in range(layers)])),
            ("head", Head(dim, vocab)),
        ]))
        x = torch.randint(0, vocab, (batch, seq))
        return model, x, _CrossEntropy(torch.randint(0, vocab, (batch, seq)))

    return _seeded(seed, device, build)


def mlp_chain(*, batch: int = 256, in_features: int = 256,
              widths: tuple[int, ...] = (2048, 256, 1024, 128, 4096, 512), classes: int = 10, seed: int = 0,
              device: str | torch.device | None = None) -> Demo:
    """Dense layers (Linear + ReLU) of very different ``widths``, then a linear classifier.

    Stages: ``fc1`` ... ``fcK``, ``head``.
    """
    def build() -> Demo:
        dims = (in_features, *widths)
        stages = [(f"fc{k + 1}", Dense(dims[k], dims[k + 1])) for k in range(len(widths))]
        model = nn.Sequential(OrderedDict(stages + [("head", nn.Linear(dims[-1], classes))]))
        x = torch.randn(batch, in_features)
        return model, x, _CrossEntropy(torch.randint(0, classes, (batch,)))

    return _seeded(seed, device, build)


class ResNetSkip(nn.Module):
    """A ResNet with its own ``forward()`` (not a Sequential), laid out like torchvision's ResNet."""

    def __init__(self, width: int, blocks: tuple[int, ...], classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        for name, layer in _layers(width, blocks):
            setattr(self, name, layer)
        self.n_layers = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 2 ** (len(blocks) - 1), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for k in range(1, self.n_layers + 1):
            x = getattr(self, f"layer{k}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet_skip(*, batch: int = 8, image: int = 64, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2, 2),
                classes: int = 10, seed: int = 0, device: str | torch.device | None = None) -> Demo:
    """The ResNet of :func:`resnet_chain` written as a plain ``nn.Module`` with skip connections in ``forward()``."""
    def build() -> Demo:
        model = ResNetSkip(width, tuple(blocks), classes)
        x = torch.randn(batch, 3, image, image)
        return model, x, _CrossEntropy(torch.randint(0, classes, (batch,)))

    return _seeded(seed, device, build)


class GPTBlock(nn.Module):
    """Pre-LN transformer block: causal self-attention and an MLP on a residual stream; the causal-mask buffer is
    sliced by the input's sequence length."""

    def __init__(self, dim: int, heads: int, seq: int, dropout: float):
        super().__init__()
        _check_heads(dim, heads)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = (self.drop(F.softmax(att, dim=-1)) @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class NanoGPT(nn.Module):
    """nanoGPT-style decoder as a plain module (not a chain by structure): tied embedding, dropout, blocks in a
    ModuleList; graph extraction cuts it into ``stem, h.0, .., head``."""

    def __init__(self, vocab: int, dim: int, heads: int, seq: int, layers: int, dropout: float = 0.1):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, dim), nn.Embedding(seq, dim), nn.Dropout(dropout)
        self.h = nn.ModuleList([GPTBlock(dim, heads, seq, dropout) for _ in range(layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(0, T, device=idx.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def nanogpt(*, batch: int = 8, seq: int = 128, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 6,
            dropout: float = 0.1, seed: int = 0, device: str | torch.device | None = None) -> Demo:
    """A GPT-style decoder written as a plain ``nn.Module`` (see :class:`NanoGPT`), token inputs, next-token loss."""
    def build() -> Demo:
        model = NanoGPT(vocab, dim, heads, seq, layers, dropout)
        idx = torch.randint(0, vocab, (batch, seq))
        return model, idx, _CrossEntropy(torch.randint(0, vocab, (batch, seq)))

    return _seeded(seed, device, build)


DEMOS: dict[str, Callable[..., Demo]] = {
    "resnet_chain": resnet_chain,
    "transformer_chain": transformer_chain,
    "mlp_chain": mlp_chain,
    "resnet_skip": resnet_skip,
    "nanogpt": nanogpt,
}
DEFAULT_DEMO = "resnet_chain"


def demo_model(name: str | None = None, **kwargs: Any) -> Demo:
    """``(model, sample_input, loss_fn)`` of the demo ``name`` (default :data:`DEFAULT_DEMO`); kwargs go to it."""
    name = DEFAULT_DEMO if name is None else name
    if name not in DEMOS:
        raise HChainError(f"unknown demo model {name!r}; choose one of: {', '.join(DEMOS)}")
    build = DEMOS[name]
    accepted = inspect.signature(build).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise HChainError(f"demo model {name!r} has no option(s) {', '.join(unknown)}; it takes: "
                          f"{', '.join(accepted)}")
    return build(**kwargs)


# ---------------------------------------------------------------------------------------------- Hugging Face
# family -> (config class, model class, config fields for (layers, hidden, heads, intermediate, kv heads)); an
# encoder-decoder family names its encoder's and its decoder's field for each
Fields = str | tuple[str, ...]
HF_FAMILIES: dict[str, tuple[str, str, tuple[Fields, Fields, Fields, Fields | None, Fields | None]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", ("n_layer", "n_embd", "n_head", "n_inner", None)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "num_key_value_heads")),
    "bert": ("BertConfig", "BertForSequenceClassification",
             ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", None)),
    "vit": ("ViTConfig", "ViTForImageClassification",
            ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", None)),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             (("encoder_layers", "decoder_layers"), "d_model", ("encoder_attention_heads", "decoder_attention_heads"),
              ("encoder_ffn_dim", "decoder_ffn_dim"), None)),
    "t5": ("T5Config", "T5ForConditionalGeneration", (("num_layers", "num_decoder_layers"), "d_model", "num_heads",
                                                       "d_ff", None)),
}


def _fields(fields: Fields) -> tuple[str, ...]:
    return (fields,) if isinstance(fields, str) else fields


class _OwnLoss:
    """``loss_fn(output)``: the loss a Hugging Face model computed itself from the ``labels`` it was given."""

    def __call__(self, output: Any) -> torch.Tensor:
        return output["loss"]

    def __repr__(self) -> str:
        return "output.loss"


def hf_model(family: str, *, batch: int = 2, seq: int = 128, layers: int | None = None, hidden: int | None = None,
             heads: int | None = None, vocab: int | None = None, attn_implementation: str | None = None,
             seed: int = 0, **overrides: Any) -> tuple[nn.Module, dict[str, torch.Tensor], Callable]:
    """A Hugging Face model built from its family's **default** config, in train mode, random weights.

    ``family``: one of :data:`HF_FAMILIES` (``"gpt2"``, ``"llama"`` — rotary embeddings and grouped-query
    attention, as Mistral and Qwen2 — ``"bert"``, ``"vit"``, and the encoder-decoders ``"bart"`` and ``"t5"``).
    ``layers``, ``hidden``, ``heads``, ``vocab`` shrink the default config (``None`` keeps the default; the MLP stays
    4x ``hidden``, LLaMA keeps 2 query heads per key/value head, an encoder-decoder gets ``layers`` in the encoder and
    as many in the decoder, and T5 without a ``decoder_start_token_id`` starts from its pad token, as every released
    T5 does). ``seq`` is the number of tokens (ViT: the image side is ``seq`` pixels, 16-pixel patches; BART and T5:
    the source and the target sequence each).
    ``attn_implementation``: ``"eager"`` materialises the attention probabilities, ``"sdpa"`` fuses them, ``None``
    lets transformers choose. ``overrides``: any other config fields (``patch_size=4``).
    Returns ``(model, inputs, loss_fn)`` with ``inputs`` a dict (``input_ids``,
    ``attention_mask`` where the family has one, ``labels``: the tokens themselves for a decoder, a class for BERT
    and ViT, a random target sequence for BART and T5) and ``loss_fn`` returning ``output.loss``.
    Needs ``transformers``; raises :class:`~hchain_viz.errors.HChainError` for an unknown family.
    """
    if family not in HF_FAMILIES:
        raise HChainError(f"unknown Hugging Face family {family!r}; choose one of: {', '.join(HF_FAMILIES)}")
    import transformers

    config_name, model_name, (f_layers, f_hidden, f_heads, f_inner, f_kv) = HF_FAMILIES[family]
    config = getattr(transformers, config_name)()
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    inner = None if hidden is None else 4 * hidden
    for fields, value in ((f_layers, layers), (f_hidden, hidden), (f_heads, heads), (f_inner, inner)):
        if fields is not None and value is not None:
            for field_ in _fields(fields):
                setattr(config, field_, value)
    if f_kv is not None and (heads is not None or hidden is not None):
        setattr(config, f_kv, max(1, getattr(config, f_heads) // 2))
    if family == "t5":
        config.d_kv = config.d_model // config.num_heads  # T5's own heads are d_model / heads wide too
        if getattr(config, "decoder_start_token_id", None) is None:  # as every released T5 config sets it
            config.decoder_start_token_id = config.pad_token_id
    if vocab is not None and hasattr(config, "vocab_size"):
        config.vocab_size = vocab
    if family == "gpt2":
        config.n_positions = max(config.n_positions, seq)
    if family == "vit":
        config.image_size = seq
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise HChainError(f"{config_name} has no field {name!r}")
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).train()
        if family == "vit":
            inputs = {"pixel_values": torch.randn(batch, config.num_channels, seq, seq),
                      "labels": torch.randint(0, config.num_labels, (batch,))}
        else:
            ids = torch.randint(0, config.vocab_size, (batch, seq))
            inputs = {"input_ids": ids}
            if family in ("bert", "bart", "t5"):
                inputs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
            if family == "bert":
                inputs["labels"] = torch.randint(0, config.num_labels, (batch,))
            elif family in ("bart", "t5"):  # a target sequence; the decoder reads it shifted right
                inputs["labels"] = torch.randint(0, config.vocab_size, (batch, seq))
            else:
                inputs["labels"] = ids
    return model, inputs, _OwnLoss()

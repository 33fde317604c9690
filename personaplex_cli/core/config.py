"""Architecture descriptions: PersonaPlex defaults, overridable by `personaplex-arch.json`.

The groups and key names are exactly the keyword arguments of Kyutai's reference loaders
(`moshi.models.loaders._seanet_kwargs`, `_transformer_kwargs`, `_quantizer_kwargs`,
`_lm_kwargs`), so anyone can dump the reference's kwargs next to its weights and point
`--model` at the folder. A group or key left out keeps its default; an unknown key is an error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

SEANET_DEFAULTS: dict[str, Any] = {
    "channels": 1,
    "dimension": 512,
    "causal": True,
    "n_filters": 64,
    "n_residual_layers": 1,
    "activation": "ELU",
    "compress": 2,
    "dilation_base": 2,
    "disable_norm_outer_blocks": 0,
    "kernel_size": 7,
    "residual_kernel_size": 3,
    "last_kernel_size": 3,
    "norm": "none",
    "pad_mode": "constant",
    "ratios": [8, 6, 5, 4],
    "true_skip": True,
}

MIMI_TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "d_model": 512,
    "num_heads": 8,
    "num_layers": 8,
    "causal": True,
    "layer_scale": 0.01,
    "context": 250,
    "conv_layout": True,
    "max_period": 10000,
    "gating": "none",
    "norm": "layer_norm",
    "positional_embedding": "rope",
    "dim_feedforward": 2048,
    "input_dimension": 512,
    "output_dimensions": [512],
}

QUANTIZER_DEFAULTS: dict[str, Any] = {
    "dimension": 256,
    "n_q": 32,
    "bins": 2048,
    "input_dimension": 512,
    "output_dimension": 512,
}

@dataclass(frozen=True)
class Sampling:
    """How a stream samples; the defaults are NVIDIA's and every command's."""

    temp_text: float = 0.7
    top_k_text: int = 25  # 0: every token
    temp_audio: float = 0.8
    top_k_audio: int = 250
    greedy: bool = False


# The largest seed any command or caller gives: a row k of a run seeded S draws from S + k,
# and torch's generators take seeds below 2**64.
MAX_SEED = 2 ** 63 - 1

# Text token ids with no text: PAD fills the frames between words, EPAD ends a pad run.
TEXT_PAD = 3
TEXT_EPAD = 0

LM_DEFAULTS: dict[str, Any] = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": TEXT_PAD,
    "n_q": 16,
    "dep_q": 16,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": 4224,
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_causal": True,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}

MIMI_NUM_CODEBOOKS = 8
# Where the assistant's Mimi codes sit in a frame's 17 tokens (0 is the text, 9..16 the
# caller's).
ASSISTANT_CODES = slice(1, 1 + MIMI_NUM_CODEBOOKS)
SAMPLE_RATE = 24000
FRAME_RATE = 12.5
FRAME_SIZE = 1920  # samples per 80 ms frame at 24 kHz
FRAME_SECONDS = FRAME_SIZE / SAMPLE_RATE  # 0.08
FRAME_MS = 1000 * FRAME_SECONDS  # 80.0
ENCODER_FRAME_RATE = 25.0  # SEANet output rate; a stride-2 conv takes it to FRAME_RATE
CARDINALITY = 2048  # entries per Mimi codebook
# The attention window rules once a KV ring is full (core/layers.py says what each does).
# Conversations follow NVIDIA's fork, the codec commands (encode, decode) Kyutai's reference.
Window = Literal["exact", "kyutai", "nvidia"]
WINDOWS: tuple[Window, ...] = get_args(Window)
CONVERSATION_WINDOW: Window = "nvidia"
CODEC_WINDOW: Window = "kyutai"
# How the LM's transformer weights may be stored (core/quantize.py): named here, where the
# CLI can read them without torch. int8 and int8-weights store the same bytes; int8 also
# quantizes each activation row on the CPU (fbgemm), int8-weights never does.
Quantize = Literal["none", "int8", "int8-weights", "int4", "fp8"]
QUANTIZE_MODES: tuple[Quantize, ...] = get_args(Quantize)
INT8_MODES: tuple[Quantize, ...] = ("int8", "int8-weights")  # one kernel on CUDA, one cost
# --compile: the depformer's step through torch.compile on the CPU (model/compiled.py)
CompileMode = Literal["auto", "on", "off"]
COMPILE_MODES: tuple[CompileMode, ...] = get_args(CompileMode)
# Off unless asked for: on the only CPU measured (2 cores, nothing else running) the
# compiled depformer frame was slower than the eager one (int8 65.6 against 61.3 ms, int4
# 55.7 against 47.8), and loading its cached code added about 38 s to every start
# (docs/performance.md).
DEFAULT_COMPILE: CompileMode = "off"
# torch's int4 tensor-core kernel (`_weight_int4pack_mm`) needs Ampere or newer
INT4_CUDA_CAPABILITY = (8, 0)
# The precisions a model may be loaded in (model/model.py maps them to torch dtypes).
DtypeName = Literal["bf16", "fp16", "fp32"]
DTYPE_NAMES: tuple[DtypeName, ...] = get_args(DtypeName)
# Personas kept primed (their KV history on the host, ~0.5 MB a frame at 7B) and kept
# prepared (voice and role read and tokenized), least recently used dropped first.
PERSONAS_CACHED = 8
# Newcomers primed side by side in one step of the runtime's primer (runtime/priming.py): a
# batch step costs little more than one row's, and a long role prompt holds one of them.
PRIMER_ROWS = 4


def primer_rows(capacity: int) -> int:
    """Rows of the primer beside a batch of `capacity` rows: never more than could join
    at once (a join holds a free row while it primes); none beside a batch of one, whose
    row primes in place (nobody else waits, so a second window would hold nothing)."""
    return 0 if capacity == 1 else min(PRIMER_ROWS, capacity)


class ArchError(ValueError):
    """The architecture file is malformed or names something we do not implement."""


@dataclass
class MimiArch:
    seanet: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SEANET_DEFAULTS))
    transformer: dict[str, Any] = field(
        default_factory=lambda: copy.deepcopy(MIMI_TRANSFORMER_DEFAULTS))
    quantizer: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(QUANTIZER_DEFAULTS))
    num_codebooks: int = MIMI_NUM_CODEBOOKS

    def check_supported(self) -> None:
        """Reject reference options this engine does not implement, instead of ignoring them."""
        fixed = {
            ("seanet", "causal"): True, ("seanet", "norm"): "none", ("seanet", "true_skip"): True,
            ("seanet", "pad_mode"): "constant", ("seanet", "activation"): "ELU",
            ("seanet", "channels"): 1,
            ("transformer", "causal"): True, ("transformer", "gating"): "none",
            ("transformer", "norm"): "layer_norm", ("transformer", "positional_embedding"): "rope",
            ("transformer", "conv_layout"): True,
        }
        for (group, key), want in fixed.items():
            got = getattr(self, group)[key]
            if got != want:
                raise ArchError(f"mimi.{group}.{key} = {got!r} is not supported (only {want!r})")
        if len(self.transformer["output_dimensions"]) != 1:
            raise ArchError("mimi.transformer.output_dimensions must have exactly one entry")
        if not 1 <= self.num_codebooks <= self.quantizer["n_q"]:
            raise ArchError(f"mimi.num_codebooks must be within 1..{self.quantizer['n_q']}")
        if self.quantizer["bins"] != CARDINALITY:
            raise ArchError(f"mimi.quantizer.bins must be {CARDINALITY}")


@dataclass
class Arch:
    mimi: MimiArch = field(default_factory=MimiArch)
    lm: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(LM_DEFAULTS))
    lm_given: frozenset[str] = frozenset()  # the lm keys the architecture file set


def _merge(defaults: dict[str, Any], overrides: Any, where: str) -> dict[str, Any]:
    if not isinstance(overrides, dict):
        raise ArchError(f"{where} must be a JSON object")
    merged = copy.deepcopy(defaults)
    for key, value in overrides.items():
        if key not in defaults:
            raise ArchError(f"unknown key {where}.{key}")
        merged[key] = value
    return merged


def arch_from_dict(data: Any) -> Arch:
    """Builds an Arch from the parsed JSON of a `personaplex-arch.json` file."""
    if not isinstance(data, dict):
        raise ArchError("the architecture file must hold a JSON object")
    unknown = set(data) - {"mimi", "lm"}
    if unknown:
        raise ArchError(f"unknown key {sorted(unknown)[0]!r} at the top level")
    arch = Arch()
    mimi = data.get("mimi", {})
    if not isinstance(mimi, dict):
        raise ArchError("mimi must be a JSON object")
    unknown = set(mimi) - {"seanet", "transformer", "quantizer", "num_codebooks"}
    if unknown:
        raise ArchError(f"unknown key mimi.{sorted(unknown)[0]}")
    arch.mimi.seanet = _merge(SEANET_DEFAULTS, mimi.get("seanet", {}), "mimi.seanet")
    arch.mimi.transformer = _merge(
        MIMI_TRANSFORMER_DEFAULTS, mimi.get("transformer", {}), "mimi.transformer")
    arch.mimi.quantizer = _merge(QUANTIZER_DEFAULTS, mimi.get("quantizer", {}), "mimi.quantizer")
    num_codebooks = mimi.get("num_codebooks", MIMI_NUM_CODEBOOKS)
    if not isinstance(num_codebooks, int) or isinstance(num_codebooks, bool):
        raise ArchError("mimi.num_codebooks must be an integer")
    arch.mimi.num_codebooks = num_codebooks
    arch.lm = _merge(LM_DEFAULTS, data.get("lm", {}), "lm")
    arch.lm_given = frozenset(data.get("lm", {}))
    arch.mimi.check_supported()
    return arch

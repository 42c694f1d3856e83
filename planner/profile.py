"""Latency profiles: DistServe's JSON shape, read and written, plus the terms it lacks.

DistServe's file (benchmarks/data/distserve/README.md) maps model -> TP size -> coefficients in ms:

    {"facebook/opt-13b": {"2": {"prefill": [a, b, c],            # a + b*Σl + c*Σl²
                                "decoding_smallbs": [a, b, c],   # a + b*Σ(ctx+1) + c*B, B < thr
                                "decoding_largebs": [a, b, c],   # the same, B >= thr
                                "decoding_large_small_bs_threshold": 95}}}

Ours has the same shape and adds, per TP entry, optional keys DistServe's reader ignores:
"chunked" (a fitted mixed-step intercept, ms), "decoding_by_batch" ({B: ms}, see TPProfile),
"kv_bytes_per_token" (the whole model's KV per token), "max_num_tokens" ({pp: KV tokens that fit
on the instance}), "overhead" ([base ms, ms per token] added to every step), "overhead_per_seq"
(ms per sequence of a step), "transfer" ({"bandwidth_GBps", "per_message_ms"}) and
"serving_path" (benchmarks/profiling/path.py's terms).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

Triple = tuple[float, float, float]
DEFAULT_THRESHOLD = 95
# DistServe's simulator adds this to every step as framework (Ray) overhead: 2 ms + 1e-4 ms/token.
DISTSERVE_OVERHEAD: tuple[float, float] = (2.0, 1e-4)
# KV bytes per token (K and V, every layer, fp16) for the models of the published profiles.
KV_BYTES_PER_TOKEN = {
    "facebook/opt-13b": 2 * 40 * 5120 * 2,
    "facebook/opt-66b": 2 * 64 * 9216 * 2,
    "facebook/opt-175b": 2 * 96 * 12288 * 2,
}


def _triple(where: str, value: Any) -> Triple:
    if not (isinstance(value, list | tuple) and len(value) == 3):
        raise ValueError(f"{where} must be a list of three numbers [a, b, c], got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


@dataclass(frozen=True)
class TPProfile:
    """One model at one TP size. Times in ms."""

    prefill: Triple
    decode_small: Triple
    decode_large: Triple
    threshold: int = DEFAULT_THRESHOLD
    chunked_intercept: float | None = None  # a mixed step's own intercept, when fitted
    # A mixed step's prompt part, measured (a', b', c'): a' + b'*Σm + c'*Σ(m² + 2mp) on top of
    # its decodes' b*Σ(ctx+1) + c*B; None: the prefill triple's b and c with chunked_intercept.
    chunked_prefill: Triple | None = None
    kv_bytes_per_token: float | None = None
    max_num_tokens: dict[int, int] = field(default_factory=dict)  # pp -> KV tokens per instance
    overhead: tuple[float, float] = DISTSERVE_OVERHEAD
    transfer_GBps: float | None = None  # measured KV link bandwidth, GB/s
    transfer_per_message_ms: float = 0.0
    overhead_per_seq: float = 0.0  # ms per sequence in a step (its token leaving the worker)
    # The serving path measured by `pdserve profile --path` (benchmarks/profiling/path.py), in ms.
    serving_path: dict[str, float] = field(default_factory=dict)
    # A decode step's constant part (a + c*B of the triple) measured at each small batch size B:
    # the step is not linear there. On CPU, MKL's GEMM takes rows in blocks of four, so a batch
    # of 3 costs more than one of 4 (19.0 against 15.1 ms here) and a triple fitted at batches
    # 1, 4, 8, 16 runs along the cheap ones; on GPU, CUDA graphs pad a batch to its captured size.
    decode_by_batch: dict[int, float] = field(default_factory=dict)
    # The most KV tokens one decoding request holds: set when every layer of the model slides,
    # as the engine then gives back the blocks before the window; None: its whole context.
    kv_window_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(
                f"decoding_large_small_bs_threshold must be >= 1, got {self.threshold}"
            )

    def decode_step_ms(self, batch_size: int, sum_ctx: float) -> float:
        """One decode step of `batch_size` requests whose contexts add up to `sum_ctx`."""
        a, b, c = self.decode_triple(batch_size)
        constant = self.decode_by_batch.get(batch_size, a + c * batch_size)
        return constant + b * (sum_ctx + batch_size)

    def decode_triple(self, batch_size: int) -> Triple:
        return self.decode_small if batch_size < self.threshold else self.decode_large

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "decoding_large_small_bs_threshold": self.threshold,
            "prefill": list(self.prefill),
            "decoding_smallbs": list(self.decode_small),
            "decoding_largebs": list(self.decode_large),
            "overhead": list(self.overhead),
        }
        if self.chunked_intercept is not None:
            out["chunked"] = self.chunked_intercept
        if self.chunked_prefill is not None:
            out["chunked_prefill"] = list(self.chunked_prefill)
        if self.kv_bytes_per_token is not None:
            out["kv_bytes_per_token"] = self.kv_bytes_per_token
        if self.kv_window_tokens is not None:
            out["kv_window_tokens"] = self.kv_window_tokens
        if self.max_num_tokens:
            out["max_num_tokens"] = {str(pp): n for pp, n in sorted(self.max_num_tokens.items())}
        if self.overhead_per_seq:
            out["overhead_per_seq"] = self.overhead_per_seq
        if self.serving_path:
            out["serving_path"] = dict(self.serving_path)
        if self.decode_by_batch:
            out["decoding_by_batch"] = {
                str(b): ms for b, ms in sorted(self.decode_by_batch.items())
            }
        if self.transfer_GBps is not None:
            out["transfer"] = {
                "bandwidth_GBps": self.transfer_GBps,
                "per_message_ms": self.transfer_per_message_ms,
            }
        return out

    @classmethod
    def from_json(cls, where: str, data: dict[str, Any]) -> TPProfile:
        transfer = data.get("transfer") or {}
        return cls(
            prefill=_triple(f"{where}.prefill", data.get("prefill")),
            decode_small=_triple(f"{where}.decoding_smallbs", data.get("decoding_smallbs")),
            decode_large=_triple(f"{where}.decoding_largebs", data.get("decoding_largebs")),
            threshold=int(data.get("decoding_large_small_bs_threshold", DEFAULT_THRESHOLD)),
            chunked_intercept=data.get("chunked"),
            chunked_prefill=(
                _triple(f"{where}.chunked_prefill", data["chunked_prefill"])
                if data.get("chunked_prefill") is not None
                else None
            ),
            kv_bytes_per_token=data.get("kv_bytes_per_token"),
            kv_window_tokens=(
                int(data["kv_window_tokens"]) if data.get("kv_window_tokens") is not None else None
            ),
            max_num_tokens={int(k): int(v) for k, v in (data.get("max_num_tokens") or {}).items()},
            overhead=tuple(data.get("overhead", DISTSERVE_OVERHEAD)),  # type: ignore[arg-type]
            transfer_GBps=transfer.get("bandwidth_GBps"),
            transfer_per_message_ms=float(transfer.get("per_message_ms", 0.0)),
            overhead_per_seq=float(data.get("overhead_per_seq", 0.0)),
            serving_path={k: float(v) for k, v in (data.get("serving_path") or {}).items()},
            decode_by_batch={
                int(b): float(ms) for b, ms in (data.get("decoding_by_batch") or {}).items()
            },
        )


@dataclass(frozen=True)
class ModelProfile:
    """Every TP size profiled for one model."""

    model: str
    by_tp: dict[int, TPProfile]

    def __post_init__(self) -> None:
        if not self.by_tp:
            raise ValueError(f"{self.model}: the profile has no TP sizes")

    def tp(self, tp: int) -> TPProfile:
        if tp not in self.by_tp:
            raise ValueError(
                f"{self.model} has no profile for TP={tp}; it has {sorted(self.by_tp)}"
            )
        return self.by_tp[tp]

    def max_tokens(self, tp: int, pp: int) -> int | None:
        """KV tokens that fit on one instance of (tp, pp), None when unknown (no limit)."""
        return self.tp(tp).max_num_tokens.get(pp)

    def runnable(self, tp: int, pp: int) -> bool:
        """Profiled at this TP, and (when memory is known for this TP) fits at this PP."""
        if tp not in self.by_tp:
            return False
        known = self.by_tp[tp].max_num_tokens
        return not known or pp in known

    def with_updates(self, **changes: Any) -> ModelProfile:
        """Every TP entry with the same fields replaced (e.g. transfer_GBps, overhead)."""
        return replace(self, by_tp={tp: replace(p, **changes) for tp, p in self.by_tp.items()})


def load_profiles(path: str | Path) -> dict[str, ModelProfile]:
    """Every model of a DistServe-shaped profile file (ours or theirs)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must map model names to TP entries")
    models = {}
    for model, entries in data.items():
        by_tp = {
            int(tp): TPProfile.from_json(f"{path}:{model}.{tp}", entry)
            for tp, entry in entries.items()
        }
        kv = KV_BYTES_PER_TOKEN.get(model)
        by_tp = {
            tp: (
                p
                if p.kv_bytes_per_token is not None or kv is None
                else replace(p, kv_bytes_per_token=float(kv))
            )
            for tp, p in by_tp.items()
        }
        models[model] = ModelProfile(model, by_tp)
    return models


def load_profile(path: str | Path, model: str | None = None) -> ModelProfile:
    """One model of a profile file; `model` may be left out when the file holds one."""
    models = load_profiles(path)
    if model is None:
        if len(models) != 1:
            raise ValueError(f"{path} holds {sorted(models)}: name one with --model")
        return next(iter(models.values()))
    if model not in models:
        raise ValueError(f"{path} has no model {model!r}; it has {sorted(models)}")
    return models[model]


def save_profiles(path: str | Path, profiles: dict[str, ModelProfile]) -> None:
    data = {
        name: {str(tp): p.to_json() for tp, p in sorted(m.by_tp.items())}
        for name, m in profiles.items()
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def with_max_num_tokens(profile: ModelProfile, csv_path: str | Path) -> ModelProfile:
    """Attach DistServe's max_num_tokens.csv (model, tp, pp, max_num_tokens) to the profile."""
    limits: dict[int, dict[int, int]] = {}
    with open(csv_path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["model"] == profile.model:
                limits.setdefault(int(row["tp"]), {})[int(row["pp"])] = int(row["max_num_tokens"])
    by_tp = {
        tp: replace(p, max_num_tokens=limits.get(tp, p.max_num_tokens))
        for tp, p in profile.by_tp.items()
    }
    return replace(profile, by_tp=by_tp)

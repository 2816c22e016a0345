"""The compatibility tool (``scripts/compat-matrix`` runs :func:`document.main`): every patch's own
check against real upstream releases, one section per upstream, as ``docs/compatibility.md``.

Its modules, each with one job: ``fetch`` (release files from PyPI, sha256-checked and cached),
``table`` (what every section shares: a patch's cell on a release, ``Section``, drift),
``vllm_sections``, ``transformers_section``, ``liger_section``, ``runtime_sections`` (tensordict,
torch_npu, megatron-core, Megatron-Bridge, verl, torch) and ``verl_watch`` (verl's own patch sites),
and ``document`` (the document, ``--check`` / ``--latest``, the command line). The names below are the tool's face for
the tests; a test that replaces a function replaces it in the module that holds it
(``fetch.newer_versions``), where its callers look it up.
"""

from __future__ import annotations

import verl_sites

from compat_matrix import fetch
from compat_matrix.document import DOC, SECTIONS, WATCHED, compute, document, latest, main, render
from compat_matrix.fetch import CACHE, Artifact, download, extract, index_json, newer_versions
from compat_matrix.liger_section import LIGER, LIGER_FILE, liger_replacements
from compat_matrix.runtime_sections import RUNTIME_RELEASES, compute_runtime, render_runtime, runtime_files
from compat_matrix.table import decide, gate, read_files, static_patches
from compat_matrix.transformers_section import TRANSFORMERS, TRANSFORMERS_VERSIONS
from compat_matrix.verl_watch import VERL, parity_rows, verl_root
from compat_matrix.vllm_sections import ASCEND, RELEASES, VLLM, VLLM_VERSIONS, fetch_release, paired_vllm

__all__ = [
    "ASCEND",
    "CACHE",
    "DOC",
    "LIGER",
    "LIGER_FILE",
    "RELEASES",
    "RUNTIME_RELEASES",
    "SECTIONS",
    "TRANSFORMERS",
    "TRANSFORMERS_VERSIONS",
    "VERL",
    "VLLM",
    "VLLM_VERSIONS",
    "WATCHED",
    "Artifact",
    "compute",
    "compute_runtime",
    "decide",
    "document",
    "download",
    "extract",
    "fetch",
    "fetch_release",
    "gate",
    "index_json",
    "latest",
    "liger_replacements",
    "main",
    "newer_versions",
    "paired_vllm",
    "parity_rows",
    "read_files",
    "render",
    "render_runtime",
    "runtime_files",
    "static_patches",
    "verl_root",
    "verl_sites",
]

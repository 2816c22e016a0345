"""``verl.npu_version_probe``: verl's ``get_npu_versions`` asks ``npu-smi`` about a card the
container can see, not only card 1.

verl (0.8.0 to 0.9.1) reads the driver's software version with ``npu-smi info -t board -i 1``. In
a container that mounts other cards (``/dev/davinci4`` to ``davinci7``: npu-smi keeps the physical
NPU ids) that call fails (exit 215); verl then tries the first id of ``ASCEND_VISIBLE_DEVICES``
(and half of it, for A3 dies), which only exists under Ascend's container runtime, and otherwise
re-raises: the NPU platform cannot start (verl issues #6756, #6773; the recipe's
``0001-get_npu_versions-first-visible-npu-id.patch``). ``ASCEND_RT_VISIBLE_DEVICES`` would not help:
it holds logical device indices, not the NPU ids ``npu-smi -i`` takes.

The fix wraps the function. When the original fails on an ``npu-smi`` error, it asks ``npu-smi
info -m`` for the first NPU id holding a logical chip (auxiliary chips such as the MCU have logical
id ``-``) and runs the original again with ``ASCEND_VISIBLE_DEVICES`` naming that card, which
verl's own fallback then probes; the variable is restored afterwards, under a lock. A host where
card 1 answers is not touched at all, and when the table names no card the first error is raised
as before. Decided from the code: a ``get_npu_versions`` that already reads ``npu-smi info -m`` is
fixed upstream.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Verdict,
    around,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)

MODULE = "verl.utils.device"
VARIABLE = "ASCEND_VISIBLE_DEVICES"
CARD_ONE = '["npu-smi","info","-t","board","-i","1"]'
MAPPING = '"info","-m"'
_LOCK = threading.Lock()


@decides(f"{MODULE}:get_npu_versions")
def probe_rule(code: Code) -> Verdict:
    if code.has(MAPPING):
        return fixed_upstream("get_npu_versions reads the NPU id mapping (npu-smi info -m) itself")
    if not code.has(CARD_ONE):
        return unsupported("get_npu_versions probing `npu-smi info -t board -i 1`", "another probe")
    return APPLY


def first_card(table: str) -> int | None:
    """The first NPU id holding a logical chip in ``npu-smi info -m`` output (rows ``NPU ID, Chip
    ID, Chip Logic ID, Chip Name``), or ``None``."""
    for line in table.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[0].isdigit() and cells[1].isdigit() and cells[2].isdigit():
            return int(cells[0])
    return None


def visible_card() -> int | None:
    """``first_card`` of this host's ``npu-smi info -m``; ``None`` when npu-smi cannot tell."""
    import subprocess

    try:
        shown = subprocess.run(["npu-smi", "info", "-m"], capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):  # no npu-smi, or it failed: the original error stands
        return None
    return first_card(shown.stdout)


@contextmanager
def _naming(card: int) -> Iterator[None]:
    """``ASCEND_VISIBLE_DEVICES`` names ``card`` for the duration, then is as it was."""
    with _LOCK:
        before = os.environ.get(VARIABLE)
        os.environ[VARIABLE] = str(card)
        try:
            yield
        finally:
            if before is None:
                del os.environ[VARIABLE]
            else:
                os.environ[VARIABLE] = before


def get_npu_versions(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """verl's probe; when ``npu-smi`` fails on card 1, again with the first visible card named."""
    import subprocess

    try:
        return original(*args, **kwargs)
    except subprocess.CalledProcessError:
        card = visible_card()
        if card is None:
            raise
    with _naming(card):
        return original(*args, **kwargs)


PATCHES = [
    wrapping_patch(
        "verl.npu_version_probe",
        "verl's get_npu_versions probes the first NPU npu-smi lists when card 1 is not in the container.",
        rule=probe_rule,
        wrap=around(get_npu_versions),
        reference="https://github.com/verl-project/verl/issues/6756",
    ),
]

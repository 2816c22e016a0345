"""``conftest.py`` of the child pytest: the torch_npu test double, our transformers patches active
in a private engine, and at the end a JSON summary (records, emulated op calls) for the parent."""

from __future__ import annotations

import json
import os
import sys

from tests.hf import npu_emulation
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import transformers_npu

sys.modules["torch_npu"] = npu_emulation
npu_emulation.integer_histc()  # for the whole child session, as on the device
ENGINE = Engine(transformers_npu.PATCHES, Config(device="npu"))
ENGINE.activate("upstream-mixin")


def pytest_sessionfinish(session, exitstatus) -> None:
    summary = {
        "records": {n: [r.state, r.reason, r.target] for n, r in ENGINE.records.items()},
        "calls": dict(npu_emulation.calls),
    }
    with open(os.environ["AUTOPATCH_SUMMARY"], "w") as out:
        json.dump(summary, out)

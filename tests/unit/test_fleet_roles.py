"""``fleet``'s role of a process, from its command line and the title Ray and vLLM give it."""

from __future__ import annotations

import pytest

from verl_npu_autopatch.cli.fleet import role

SPAWN = [
    "/usr/bin/python3",
    "-c",
    "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
    "--multiprocessing-fork",
]


@pytest.mark.parametrize(
    ("argv", "title", "expected"),
    [
        (["python3", "-m", "verl.trainer.main_ppo", "trainer.nnodes=2"], "python3 -m verl.trainer.main_ppo", "driver"),
        (["python3", "train.py"], "", "driver"),
        (
            ["python3", "/x/ray/_private/workers/default_worker.py", "--node-ip-address=1"],
            "ray::WorkerDict.init",
            "Ray worker",
        ),
        (["python3", "/x/ray/_private/workers/default_worker.py"], "", "Ray worker"),  # title unknown: the argv says it
        (SPAWN, "VLLM::EngineCore", "vLLM EngineCore"),
        (SPAWN, "VLLM::EngineCore_DP1", "vLLM EngineCore"),
        (SPAWN, "VLLM::Worker_TP0", "vLLM worker"),
        (SPAWN, "VLLM::Worker_PP1_TP3 ", "vLLM worker"),
        (SPAWN, " ".join(SPAWN), "other"),  # a spawn child nobody retitled
    ],
)
def test_role(argv: list[str], title: str, expected: str) -> None:
    assert role(argv, title) == expected

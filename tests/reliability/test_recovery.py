"""Round 3 of the fault matrix (issue 22): activation and first imports interrupted, failing,
forked, chained through another finder or run in a sub-interpreter, in real child interpreters
(venvs with the built wheel and the fixture packages). ``docs/reliability.md`` names each case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.children import ROOT, run, run_json

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}


def test_retried_first_import_is_patched(base_python: Path) -> None:
    # the watched package's first import raises (a transient error) while its own module is a
    # target; the retry must load patched without any other target import to rescue it
    code = """
import json
try:
    import vllm
    first = "imported"
except ImportError as exc:
    first = str(exc)
import vllm, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([first, vllm.Engine().run(), r.status, r["fixture.trigger"].state]))
"""
    first, ran, status, state = run_json(base_python, code, env={**NPU, "AUTOPATCH_FIXTURE_FLAKY": "1"})
    assert "transient failure" in first
    assert (ran, status, state) == ("patched:upstream", "active", "applied")


@pytest.mark.parametrize("again", ["import", "activate"])
def test_keyboard_interrupt_during_activation(base_python: Path, again: str) -> None:
    # Ctrl-C while the first watched import activates: the KeyboardInterrupt reaches the user and
    # a later watched import, or activate(), activates again
    code = f"""
import json
try:
    import vllm.model
    first = "imported"
except KeyboardInterrupt:
    first = "interrupted"
import verl_npu_autopatch
between = verl_npu_autopatch.report().status
if {again!r} == "activate":
    verl_npu_autopatch.activate()
import vllm, vllm.model
r = verl_npu_autopatch.report()
print(json.dumps([first, between, vllm.model.Layer().forward(1), vllm.Engine().run(), r.status,
                  r["fixture.forward"].state, r["fixture.trigger"].state]))
"""
    seen = run_json(base_python, code, env={**NPU, "AUTOPATCH_FIXTURE_LOAD": "interrupt"})
    assert seen == ["interrupted", "not-activated", 12, "patched:upstream", "active", "applied", "applied"]


def test_fork_while_another_thread_activates(tmp_path: Path, base_python: Path) -> None:
    # the child of a fork made while another thread activates: nothing held, no lock inherited;
    # it imports at once and activates by itself
    gate = tmp_path / "gate"
    code = f"""
import importlib.util, json, os, threading, time
import verl_npu_autopatch
from verl_npu_autopatch.engine import lifecycle as engine
from verl_npu_autopatch.bootstrap.startup import OBSERVER
worker = threading.Thread(target=__import__, args=("vllm.model",))
worker.start()
while not os.path.exists({str(gate)!r} + ".waiting"):  # activating: the plugin's load waits for the gate
    time.sleep(0.001)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    del os.environ["AUTOPATCH_FIXTURE_LOAD_GATE"]
    spec = importlib.util.find_spec("autopatch_target")
    seen = [engine.engine().status, OBSERVER.mode != "guarding", type(spec.loader).__name__]
    if seen[:2] == ["not-activated", True]:  # else the imports below would wait 300 s
        import autopatch_target
        verl_npu_autopatch.activate()
        seen += [verl_npu_autopatch.report().status, autopatch_target.Thing().hello()]
    os.write(write, json.dumps(seen).encode())
    os._exit(0)
open({str(gate)!r}, "w").close()
worker.join()
os.waitpid(pid, 0)
import vllm.model
child = json.loads(os.read(read, 65536).decode())
print(json.dumps([child, verl_npu_autopatch.report().status, vllm.model.Layer().forward(1)]))
"""
    child, parent, forward = run_json(base_python, code, env={**NPU, "AUTOPATCH_FIXTURE_LOAD_GATE": str(gate)})
    assert child == ["not-activated", True, "SourceFileLoader", "active", "patched:upstream"]
    assert (parent, forward) == ("active", 12)


FAILING = """
import json, sys, traceback
try:
    import megatron
except ValueError as exc:
    frames = [(f.filename, f.name, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    print(json.dumps([sys.version_info[:2] >= (3, 11), repr(exc), exc.__cause__, exc.__context__, frames]))
"""


@pytest.mark.parametrize("host", ["inactive", "active"])
def test_failing_first_import_shows_only_upstream_frames(tmp_path: Path, any_python: Path, host: str) -> None:
    # a watched package whose body raises: the same exception as without the package, and (3.11+)
    # the same traceback. Python 3.10 re-raises the traceback it caught, with our frames, and
    # then keeps the import system's frames in front of them too: the upstream frames are the same
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("raise ValueError('upstream bug')\n")
    path = {"PYTHONPATH": str(tmp_path)}
    without = run_json(any_python, FAILING, env={**path, "VERL_NPU_AUTOPATCH": "0"})
    seen = run_json(any_python, FAILING, env={**path, **(NPU if host == "active" else {})})
    assert seen[:4] == without[:4] == [seen[0], "ValueError('upstream bug')", None, None]
    if seen[0]:  # 3.11+
        assert seen[4] == without[4]
    else:
        upstream = [f for f in seen[4] if not f[0].startswith("<frozen") and "verl_npu_autopatch" not in f[0]]
        assert upstream == [f for f in without[4] if not f[0].startswith("<frozen")]


#: A finder that asks the finders after itself and wraps their loader, as APM agents and coverage
#: tools do; put first on ``sys.meta_path``, in front of the start-up hook.
CHAINING = """
import sys

class Wrapped:
    def __init__(self, loader):
        self.loader = loader
    def __getattr__(self, name):
        return getattr(self.loader, name)
    def create_module(self, spec):
        return self.loader.create_module(spec)
    def exec_module(self, module):
        Chaining.loaded.append(module.__name__)
        return self.loader.exec_module(module)

class Chaining:
    loaded = []
    def find_spec(self, name, path=None, target=None):
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = Wrapped(spec.loader)
                return spec
        return None

sys.meta_path.insert(0, Chaining())
"""


def test_chaining_finder_in_front(base_python: Path) -> None:
    code = (
        CHAINING
        + """
import json, vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r.status, r["fixture.forward"].state,
                  [m for m in Chaining.loaded if m.startswith("vllm")]]))
"""
    )
    proc = run(base_python, code, env=NPU)
    assert proc.stderr == ""
    assert json.loads(proc.stdout.splitlines()[-1]) == [12, "active", "applied", ["vllm", "vllm.model"]]


#: A finder whose ``__getattr__`` raises for any attribute it lacks (a proxy, a lazy agent): the import
#: system reads only its ``find_spec``, so without us every import works.
TOUCHY = """
import json, sys

class Touchy:
    def __getattr__(self, name):
        raise RuntimeError(f"no {name} here")
    def find_spec(self, name, path=None, target=None):
        return None

sys.meta_path.append(Touchy())
import vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r.status, r.states().get("fixture.forward")]))
"""


@pytest.mark.parametrize("host", ["inactive", "active"])
def test_a_finder_whose_getattr_raises_breaks_no_import(base_python: Path, host: str) -> None:
    # our hook asked every finder whether it was ours with getattr(): the RuntimeError broke `import vllm`
    proc = run(base_python, TOUCHY, env=NPU if host == "active" else {}, check=False)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen == ([12, "active", "applied"] if host == "active" else [2, "inactive", None])


#: Cirq's import test: every finder wrapped in one that asks it again (by keyword, or by position).
WRAPPED = """
import json, sys

class Wrapping:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, fullname, path=None, target=None):
        if KEYWORDS:
            return self.finder.find_spec(fullname, path=path, target=target)
        return self.finder.find_spec(fullname, path, target)

saved = sys.meta_path
sys.meta_path = [Wrapping(finder) for finder in sys.meta_path]
try:
    import csv, vllm.model
    forward = vllm.model.Layer().forward(1)
finally:
    sys.meta_path = saved
import verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([forward, r.status, r.states().get("fixture.forward")]))
"""


@pytest.mark.parametrize("host", ["inactive", "active"])
@pytest.mark.parametrize("ask", ["by keyword", "by position"])
def test_a_finder_wrapping_ours_breaks_no_import(base_python: Path, host: str, ask: str) -> None:
    # by keyword: the .pth placeholder took no path=, target=: every import raised TypeError;
    # by position: the wrapped hook asked itself again through the wrapper, without end (a hang)
    code = WRAPPED.replace("KEYWORDS", str(ask == "by keyword"))
    seen = run_json(base_python, code, env=NPU if host == "active" else {}, timeout=60)
    assert seen == ([12, "active", "applied"] if host == "active" else [2, "inactive", None])


#: The application's logging handler, whose ``emit`` reads a field of its own records (no ``handleError``).
FIELD_HANDLER = """
import json, logging, sys

class Forward(logging.Handler):
    def emit(self, record):
        sys.stderr.write(f"[{record.request_id}] {record.getMessage()}\\n")

def configure():
    logging.basicConfig(level=logging.INFO, handlers=[Forward()])

if WHEN == "before":
    configure()
import vllm
if WHEN == "after":
    configure()
import vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r.status, r.states().get("fixture.forward")]))
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_logging_handler_failing_on_our_records_breaks_no_import(base_python: Path, when: str) -> None:
    # configured before the first watched import: activation "failed" and nothing was patched;
    # after it: the AttributeError of its emit came out of the user's `import vllm.model`
    seen = run_json(base_python, FIELD_HANDLER.replace("WHEN", repr(when)), env=NPU)
    assert seen == [12, "active", "applied"]


def test_torch_npu_blocked_in_sys_modules_is_not_installed(base_python: Path) -> None:
    # `sys.modules["torch_npu"] = None` (the idiom that makes its import fail) counted as installed:
    # a host without the NPU stack went active, "npu (torch_npu installed)", and patched
    code = """
import json, sys
sys.modules["torch_npu"] = None
import vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r.status, r.device]))
"""
    assert run_json(base_python, code) == [2, "inactive", "none (torch_npu not installed)"]


def test_a_proxy_over_our_fix_is_not_applied(base_python: Path) -> None:
    # naming the new owner read attributes of its proxy, whose __getattr__ raised RuntimeError: the
    # re-check gave up and the record stayed `applied` while the proxy ran
    code = """
import json, vllm.model, verl_npu_autopatch

class Proxy:
    def __getattr__(self, name):
        raise RuntimeError(f"the proxy has no {name}")
    def __get__(self, obj, cls=None):
        return lambda x: 1000

vllm.model.Layer.forward = Proxy()
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r["fixture.forward"].state, r["fixture.forward"].reason]))
"""
    forward, state, reason = run_json(base_python, code, env=NPU)
    assert (forward, state) == (1000, "superseded")
    assert reason.startswith("replaced by ") and "Proxy" in reason


#: A finder forbidding ``torch*`` imports the way a test does, with a ``BaseException`` (``pytest.fail``'s ``Failed``).
FORBIDDING = """
import json, sys

class Failed(BaseException):
    pass

class Forbid:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torch"):
            raise Failed(f"importing {name} is forbidden in this test")
        return None

sys.meta_path.insert(0, Forbid())
import vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r.status, r.states().get("fixture.forward")]))
"""


@pytest.mark.parametrize("host", ["inactive", "active"])
def test_a_finder_raising_a_base_exception_on_our_probe_breaks_no_import(base_python: Path, host: str) -> None:
    # asking every finder whether torch_npu (or a target package) can be found let its Failed out
    # of the user's `import vllm.model`, which never imports torch
    seen = run_json(base_python, FORBIDDING, env=NPU if host == "active" else {})
    assert seen == ([12, "active", "applied"] if host == "active" else [2, "inactive", None])


def test_a_lazy_proxy_in_sys_modules_at_a_target_fails_no_activation(base_python: Path) -> None:
    # reading the proxy's __spec__ (or wrapt handing it to our hook) raised: `report()` said the
    # activation failed while the fixes registered before it ran
    code = """
import json, sys

class Lazy:
    def __getattr__(self, name):
        raise RuntimeError("lazy: not loaded")

sys.modules["vllm.old_layout"] = Lazy()
import vllm, vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.Engine().run(), vllm.model.Layer().forward(1), r.status, r.states()["fixture.forward"]]))
"""
    assert run_json(base_python, code, env=NPU) == ["patched:upstream", 12, "active", "applied"]


#: Runs ``CODE`` in an isolated sub-interpreter (the module's name differs per version).
SUBINTERPRETER = """
import json, sys
try:
    import _interpreters as interpreters  # 3.13+
    ident = interpreters.create(interpreters.new_config("isolated"))
    run = interpreters.exec
except ImportError:
    import _xxsubinterpreters as interpreters  # 3.10-3.12
    ident = interpreters.create(isolated=True)
    run = interpreters.run_string
failure = run(ident, CODE)
interpreters.destroy(ident)
print(json.dumps({"failure": repr(failure)}))
"""

INSIDE = """
import json, sys
import vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([r.status, r.reason, vllm.model.Layer().forward(1), "wrapt" in sys.modules]), flush=True)
"""


def test_isolated_subinterpreter_stays_inactive(any_python: Path) -> None:
    probe = "import importlib.util as u; print(bool(u.find_spec('_interpreters') or u.find_spec('_xxsubinterpreters')))"
    if run(any_python, probe, fixtures=False).stdout.strip() != "True":
        pytest.skip("this Python has neither _interpreters nor _xxsubinterpreters")
    proc = run(any_python, SUBINTERPRETER.replace("CODE", repr(INSIDE)), env=NPU, check=False)
    assert proc.returncode == 0, proc.stderr  # was 134 (abort at exit) on 3.12
    inside, after = (json.loads(line) for line in proc.stdout.splitlines()[-2:])
    status, reason, forward, wrapt = inside
    assert (status, forward, wrapt) == ("inactive", 2, False)
    assert "sub-interpreter" in reason
    assert after == {"failure": "None"}


def test_huge_values_give_short_warnings(base_python: Path) -> None:
    # a 100 kB value and 12,000 unknown names: a few short lines, each naming its variable
    env = {
        **NPU,
        "VERL_NPU_AUTOPATCH_STRICT": "x" * 100_000,
        "VERL_NPU_AUTOPATCH_ENABLE": ",".join(f"n{i:05}" for i in range(12_000)),
    }
    code = """
import json, vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([r.status, vllm.model.Layer().forward(1), r.warnings]))
"""
    proc = run(base_python, code, env=env)
    status, forward, warnings = json.loads(proc.stdout.splitlines()[-1])
    assert (status, forward) == ("active", 12)
    assert all(len(w) < 300 for w in warnings) and len(warnings) == 5
    assert warnings[0].startswith("VERL_NPU_AUTOPATCH_STRICT='xxx") and "(100,000 characters)" in warnings[0]
    assert "accepted values: 0 (default) / 1" in warnings[0]
    assert [w.split(";")[0] for w in warnings[1:]] == [
        "VERL_NPU_AUTOPATCH_ENABLE: unknown patch or group 'n00000'",
        "VERL_NPU_AUTOPATCH_ENABLE: unknown patch or group 'n00001'",
        "VERL_NPU_AUTOPATCH_ENABLE: unknown patch or group 'n00002'",
        "VERL_NPU_AUTOPATCH_ENABLE: 11,997 more unknown patch or group names",
    ]
    assert len(proc.stderr) < 2_000 and proc.stderr.count("\n") == 5  # logged once each


@pytest.mark.parametrize("host", ["inactive", "active"])
def test_report_survives_reloading_our_modules(base_python: Path, host: str) -> None:
    code = """
import importlib, json, sys, vllm.model, verl_npu_autopatch
before = verl_npu_autopatch.report().to_dict()
ours = sorted(n for n in sys.modules if n == "_verl_npu_autopatch_startup" or n.startswith("verl_npu_autopatch"))
for name in ours:
    importlib.reload(sys.modules[name])
after = verl_npu_autopatch.report().to_dict()
print(json.dumps([len(ours), before == after, after["status"], after["reason"], vllm.model.Layer().forward(1)]))
"""
    count, same, status, reason, forward = run_json(base_python, code, env=NPU if host == "active" else {})
    assert count > 1 and same
    if host == "active":
        assert (status, reason, forward) == ("active", "activated by vllm", 12)
    else:
        assert (status, forward) == ("inactive", 2) and "torch_npu is not installed" in reason


def test_docs_name_every_case() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    for name in [n for n in globals() if n.startswith("test_") and n != "test_docs_name_every_case"]:
        assert f"{name.removeprefix('test_')}`" in text, name

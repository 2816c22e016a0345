"""Our MoE kernel as one of transformers' own experts implementations (transformers 5.x).

transformers 5.x decorates fused experts classes with ``@use_experts_implementation``: their
``forward`` is a dispatcher that looks ``config._experts_implementation`` up in an
``ExpertsInterface`` (``eager``, ``batched_mm``, ``grouped_mm`` …), chosen by the user with
``from_pretrained(experts_implementation=...)`` / ``set_experts_implementation(...)``, or by
``PreTrainedModel.get_correct_experts_implementation(None)`` when the user made no choice.

So the experts patch does not replace the dispatcher. It

- registers :data:`NAME` (``"npu_grouped_mm"``) in the class's ``ExpertsInterface``, so the
  kernel is a valid choice like any other;
- makes :data:`NAME` the default for models defined in a patched modeling module, by wrapping
  ``get_correct_experts_implementation``: only a request of ``None`` (no choice) changes; an
  explicit ``eager`` / ``batched_mm`` / ``grouped_mm`` reaches upstream's code untouched.

Where the kernel does not fit an instance (a GELU expert, biased or expert-parallel experts), it
runs what transformers would have run without us: the implementation upstream's
``get_correct_experts_implementation(None)`` chose for that modeling module (``grouped_mm``
where the model can dispatch it, else ``eager``), never a slower eager loop in its place.

Both places are the patch's declared sites (``probes.experts_sites``). Undo removes the class
and, with the last one, the default wrapper and our name's entry in the ``ExpertsInterface``
mapping (transformers has no unregister: the entry there before, if any, is put back); a live
model we gave ours by default gets upstream's own default choice back. While others stay, a
class no longer patched runs upstream's default. Deciding again while the class is held
is "already in place" (:func:`installed`). Imported at fix time only (torch loaded).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import Counter
from typing import Any

import verl_npu_autopatch.patches.transformers_npu.kernels as kernels
from verl_npu_autopatch.authoring import ABSENT, Undo, mark, set_attribute
from verl_npu_autopatch.engine.ownership import reached_through_target
from verl_npu_autopatch.patches.transformers_npu.probes import EXPERTS_NAME, default_hook_owner, dispatcher_interface

#: The name our kernel is registered under in transformers' ``ExpertsInterface``.
NAME = EXPERTS_NAME

_lock = threading.Lock()
_classes: dict[type, bool] = {}  # patched experts class -> its weights are transposed ([E, H, 2I])
_owners: Counter[type] = Counter()  # patched experts class -> number of applied patches holding it
_modules: Counter[str] = Counter()  # modeling module -> number of patched classes (the default choice)
_upstream: dict[str, str] = {}  # modeling module -> upstream's own default choice there (the fallback)
_interfaces: dict[type, Any] = {}  # experts class ever registered -> its dispatcher's ExpertsInterface
_entries: dict[Any, Any] = {}  # ExpertsInterface class we registered in -> its entry under NAME before
_given: list[tuple[weakref.ref[Any], str]] = []  # config of a model given ours by default -> upstream's choice
_default_undo: Undo | None = None


def installed(cls: type) -> bool:
    """Whether ``cls``'s experts run our kernel by default now (the patch's live state)."""
    interface = dispatcher_interface(getattr(cls, "forward", None))
    with _lock:
        ours = cls in _classes and _default_undo is not None
    return ours and interface is not None and _registered(interface)


def _registered(interface: Any) -> bool:
    try:
        return interface[NAME] is experts_forward
    except KeyError:  # nothing registered under our name in this dispatcher yet
        return False


def experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The registered implementation: our kernel for a patched class the instance fits, else the
    implementation transformers chose by default for its modeling module (see :func:`fallback`)."""
    transposed = _classes.get(type(self))
    if transposed is None or not kernels.experts_fit(self):
        return fallback(type(self))(self, hidden_states, top_k_index, top_k_weights)
    return kernels.run_fused_experts(self, transposed, hidden_states, top_k_index, top_k_weights)


def fallback(cls: Any) -> Any:
    """What the dispatcher of ``cls`` runs for upstream's own default choice in ``cls``'s modeling
    module (recorded when a model there was given ours instead; ``eager`` before any was)."""
    eager = cls.forward.__wrapped__
    interface = _interfaces.get(cls)  # read at registration: a compiled trace cannot read closures
    name = _upstream.get(cls.__module__, "eager")
    return eager if interface is None else interface.get_interface(name, eager)


def _default_choice(original: Any) -> Any:
    @functools.wraps(original)
    def get_correct_experts_implementation(self: Any, requested_experts: str | None) -> str:
        if requested_experts is None:
            modules = [c.__module__ for c in type(self).__mro__ if c.__module__ in _modules]
            if modules:
                _upstream[modules[0]] = choice = original(self, None)  # what runs where the kernel does not fit
                config = getattr(self, "config", None)
                if config is not None:
                    _given[:] = [(ref, was) for ref, was in _given if ref() is not None and ref() is not config]
                    _given.append((weakref.ref(config), choice))
                return NAME
        return original(self, requested_experts)

    return get_correct_experts_implementation


def register(cls: type[Any], transposed: bool, patch_name: str) -> Undo:
    """Make the kernel ``cls``'s default experts implementation; returns the undo."""
    global _default_undo
    interface = dispatcher_interface(cls.forward)
    owner = default_hook_owner()
    if interface is None or owner is None:
        raise RuntimeError(f"{cls.__qualname__}: no experts dispatcher or no get_correct_experts_implementation")
    with _lock:
        if not _registered(interface):
            _entries.setdefault(type(interface), type(interface)._global_mapping.get(NAME, ABSENT))
            type(interface).register(NAME, mark(experts_forward, patch_name))
        _classes[cls] = transposed
        _interfaces[cls] = interface
        _owners[cls] += 1
        _modules[cls.__module__] += 1
        if _default_undo is None:
            original = owner.get_correct_experts_implementation
            _default_undo = set_attribute(
                owner, "get_correct_experts_implementation", mark(_default_choice(original), patch_name)
            )
    done = False

    def undo() -> None:
        global _default_undo
        nonlocal done
        with _lock:
            if done:
                return
            done = True
            _owners[cls] -= 1
            _modules[cls.__module__] -= 1
            if _owners[cls] <= 0:
                del _owners[cls]
                _classes.pop(cls, None)
            if _modules[cls.__module__] <= 0:
                del _modules[cls.__module__]
            if not _modules and _default_undo is not None:
                _default_undo()
                _default_undo = None
                _unregister()
                _give_back()

    return reached_through_target(undo)  # our kernel runs only while the class's dispatcher is live


def _unregister() -> None:
    """Put back each ``ExpertsInterface`` mapping's entry under :data:`NAME` as it was before we
    registered (removed when there was none), unless another owner replaced ours since."""
    for kind, before in _entries.items():
        mapping = kind._global_mapping
        if mapping.get(NAME) is not experts_forward:
            continue
        if before is ABSENT:
            del mapping[NAME]
        else:
            mapping[NAME] = before
    _entries.clear()


def _give_back() -> None:
    """Give each live model we chose ours for by default upstream's own default choice, the one it
    would have had without us (our name is no longer registered)."""
    for ref, choice in _given:
        config = ref()
        if config is not None and getattr(config, "_experts_implementation_internal", None) == NAME:
            config._experts_implementation_internal = choice
    _given.clear()

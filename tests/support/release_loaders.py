"""The per-family release-loader registry: which fixture loads a family's target from which releases.

A family whose target cannot be installed in its suite's environment registers, beside the fixture
that loads the target from a release's own files, in one of two forms::

    @release_loaders.loads(megatron_layer_offset, "megatron-core", ("0.12.1", "0.17.0"))
    @pytest.fixture
    def megatron_layers(monkeypatch): ...  # its value: a loader, called with a release

    @release_loaders.loads(ascend_sampler_record_stream, "vllm-ascend", ("0.23.0",), param=True)
    @pytest.fixture
    def sampler(request, releases, npu): ...  # loads the release ``request.param`` names

The suite's generic tests (its ``test_<suite>_contract.py`` and table-equals-live test) are generated
from the registry (:func:`tests`): the contract, and the live decision against the static rule's cell,
on every registered release; a family of the suite with neither a live target nor a loader fails its
completeness test. A loader fixture may use only the built-in and ``conftest.py`` fixtures: the
generic tests see it alone.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

import pytest

from tests.support import contract
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.engine import catalog

F = TypeVar("F")
#: What a generated test runs once the release is loaded: ``check(request, patch, loader, release)``.
Check = Callable[[pytest.FixtureRequest, Patch, "Loader", str], None]


@dataclass(frozen=True)
class Loader:
    """One registration: ``fixture`` (registered in ``module``) loads ``family``'s target from the
    ``releases`` of ``project`` (the distribution as the static table names it; ``None`` for a
    stand-in with no release files). ``sites``: release -> patch name -> the exact sites the contract
    must report. ``param``: the fixture loads the release it gets as ``request.param``; otherwise its
    value is a callable the test calls with the release."""

    family: str
    fixture: str
    project: str | None
    releases: tuple[str, ...]
    module: str
    function: Any = field(repr=False, compare=False)
    sites: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)
    param: bool = False

    def exact(self, patch: Patch, release: str) -> frozenset[str] | None:
        """The exact sites registered for ``patch`` on ``release``, if any."""
        return self.sites.get(release, {}).get(patch.name)


#: ``Verdict.action`` -> the state a record ends in when the live check decides it.
STATES = {"apply": "applied", "fixed-upstream": "fixed-upstream", "unsupported": "unsupported"}

#: Every registration made so far, in import order.
REGISTRY: list[Loader] = []


def loads(
    family: ModuleType,
    project: str | None,
    releases: Sequence[str],
    sites: Mapping[str, Collection[str] | Mapping[str, Collection[str]]] | None = None,
    param: bool = False,
) -> Callable[[F], F]:
    """Register the decorated fixture as the loader of ``family``'s target (its module under
    ``verl_npu_autopatch.patches``) from ``releases`` (see the module doc). ``sites``: release -> the
    exact sites of the family's one patch, or patch name -> its exact sites."""
    module = sys._getframe(1).f_globals["__name__"]  # the test module registering
    name_of_family = family.__name__.rpartition(".")[2]
    exact = {release: _per_patch(family, found) for release, found in (sites or {}).items()}
    assert set(exact) <= set(releases), f"{family.__name__}: sites of releases it does not load: {sorted(exact)}"

    def register(fixture: F) -> F:
        name = getattr(fixture, "name", None) or getattr(fixture, "__name__")  # noqa: B009
        REGISTRY.append(Loader(name_of_family, name, project, tuple(releases), module, fixture, exact, param))
        return fixture

    return register


def _per_patch(family: ModuleType, found: Collection[str] | Mapping[str, Collection[str]]) -> dict[str, frozenset[str]]:
    if isinstance(found, Mapping):
        assert set(found) <= {p.name for p in family.PATCHES}, f"{family.__name__}: sites of {sorted(found)}"
        return {name: frozenset(sites) for name, sites in found.items()}
    (patch,) = family.PATCHES  # the plain form: a family of one patch
    return {patch.name: frozenset(found)}


def collect(package: str) -> list[Loader]:
    """Import every ``test_*`` module of ``package`` (their registrations run); the loaders registered there."""
    root = importlib.import_module(package)
    for found in pkgutil.iter_modules(root.__path__):
        if found.name.startswith("test_"):
            importlib.import_module(f"{package}.{found.name}")
    return [loader for loader in REGISTRY if loader.module.startswith(f"{package}.")]


def suite(package: str, namespace: dict[str, Any]) -> tuple[list[Loader], list[tuple[str, Sequence[Patch]]]]:
    """A generic test module's set-up: the loaders ``package``'s test modules register (their
    fixtures put in ``namespace``, the module's globals, where pytest finds them) and the catalog's
    families as ``(name, patches)``."""
    loaders = collect(package)
    namespace.update(fixtures(loaders))
    return loaders, [(f.__name__.rpartition(".")[2], f.PATCHES) for f in catalog.families()]


def fixtures(loaders: Iterable[Loader]) -> dict[str, Any]:
    """Fixture name -> fixture, to put in a generic test module's namespace (where pytest finds them)."""
    found: dict[str, Any] = {}
    for loader in loaders:
        assert found.get(loader.fixture, loader.function) is loader.function, f"two fixtures {loader.fixture!r}"
        found[loader.fixture] = loader.function
    return found


def cases(
    families: Iterable[tuple[str, Sequence[Patch]]], loaders: Iterable[Loader]
) -> list[tuple[Patch, Loader, str]]:
    """``(patch, loader, release)`` for every patch of a family with a loader and every release it loads."""
    by_family: dict[str, list[Loader]] = {}
    for loader in loaders:
        by_family.setdefault(loader.family, []).append(loader)
    return [
        (patch, loader, release)
        for name, patches in families
        for loader in by_family.get(name, [])
        for patch in patches
        for release in loader.releases
    ]


def tests(prefix: str, check: Check, found: Iterable[tuple[Patch, Loader, str]]) -> dict[str, Any]:
    """One test per loader of the cases ``found``, ``<prefix>_<fixture>``, parametrized by patch and
    release (the fixture indirectly, with the release): the release loaded, it runs ``check``. Put
    them in the generic module's namespace, as its :func:`fixtures`."""
    by_fixture: dict[str, tuple[Loader, list[tuple[Patch, str]]]] = {}
    for patch, loader, release in found:
        by_fixture.setdefault(loader.fixture, (loader, []))[1].append((patch, release))
    return {f"{prefix}_{name}": _test(check, loader, pairs) for name, (loader, pairs) in by_fixture.items()}


def _test(check: Check, loader: Loader, pairs: list[tuple[Patch, str]]) -> Callable[..., None]:
    @pytest.mark.usefixtures(loader.fixture)
    @pytest.mark.parametrize(("patch", loader.fixture), pairs, indirect=[loader.fixture], ids=ids)
    def test(request: pytest.FixtureRequest, patch: Patch) -> None:
        release = request.node.callspec.params[loader.fixture]
        loaded = request.getfixturevalue(loader.fixture)
        if not loader.param:
            loaded(release)
        check(request, patch, loader, release)

    return test


def keeps_the_contract(request: pytest.FixtureRequest, patch: Patch, loader: Loader, release: str) -> None:
    """The contract on the loaded release, with the exact sites where they are registered."""
    (live,) = contract.live_patches([patch])
    finding = contract.check_contract(live)
    exact = loader.exact(patch, release)
    if exact is not None:
        assert (finding.state, finding.changed) == ("applied", exact), (finding.state, sorted(finding.changed))


def uncovered(
    families: Iterable[tuple[str, Sequence[Patch]]],
    concern: Callable[[Patch], bool],
    live: Collection[str],
    loaders: Iterable[Loader],
) -> list[str]:
    """The patches of the suite's ``concern`` neither live here (by name) nor loaded by a registered loader."""
    registered = {loader.family for loader in loaders}
    return [
        patch.name
        for name, patches in families
        for patch in patches
        if concern(patch) and patch.name not in live and name not in registered
    ]


def ids(value: object) -> str:
    """A test id part for a case's value: the patch's name, the loader's fixture, the release."""
    if isinstance(value, Patch):
        return value.name
    return value.fixture if isinstance(value, Loader) else str(value)

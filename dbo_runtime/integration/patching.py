"""A transactional patch set over vLLM's modules and classes: ``install`` builds every replacement first, applies
them all and restores them on any failure; ``uninstall`` puts back the identical originals. Modules not importable
everywhere are patched at import (``sys.meta_path``); a failure there marks only that module's patches ``broken``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from dbo_runtime.core.errors import PatchError
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.switches import parse_switch
from dbo_runtime.integration.microbatch_arming import ARMING, ArmedEntry
from dbo_runtime.integration.ubatch_failures import SHIELDS_ITSELF, MicrobatchAttr, record, shield

logger = get_logger(__name__)

_MISSING = object()
RUNNERS = (None, "mrv1", "mrv2")
PATCH_MARK = "__dbo_runtime_patch__"


@dataclass(frozen=True)
class Patch:
    """One replacement of one attribute; ``make(original)`` builds it from the object found at install (for a
    class attribute: the raw ``__dict__`` value, or the inherited one)."""

    name: str
    module: str
    attr: str
    """``"func"`` or ``"Class.method"`` inside ``module``."""
    make: Callable[[Any], Any]
    reason: str
    upstream_pr: str
    removal: str
    lazy: bool = False
    """Apply when ``module`` is first imported, not at install."""
    optional: bool = False
    """A missing target is logged and skipped instead of failing the set."""
    adds: bool = False
    """The attribute may not exist yet; ``make`` then receives None."""
    on_install: Callable[[], None] | None = None
    """Called once the replacement is in place."""
    on_uninstall: Callable[[], None] | None = None
    """Called once the original is back, also on a rollback."""
    anchors: tuple[str, ...] | None = None
    """``module:qualname`` of the vLLM code the patch relies on, fingerprinted per release. None: the target
    itself; ``()``: not bound to vLLM code."""
    architectures: tuple[str, ...] = ()
    """Architectures whose fix needs this patch (empty: all)."""
    runner: str | None = None
    """``"mrv1"`` / ``"mrv2"``: the patch serves one model runner only."""
    runs_on_ubatch_thread: bool = False
    """vLLM calls the replacement on microbatch threads, where nothing may raise: ``PatchSet`` shields it (a data
    descriptor must be a ``MicrobatchAttr``; a hot function may use ``shields_itself``)."""
    armed_at_first_microbatch: bool = False
    """vLLM's original stays until the first microbatched run (``microbatch_arming``): only for a replacement
    equal to it while no microbatch thread exists."""

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise PatchError(f"{self.name}: Patch.runner must be one of {RUNNERS}, not {self.runner!r}")

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def feature(self) -> str:
        return self.name.partition(".")[0]

    @property
    def fingerprint_anchors(self) -> tuple[str, ...]:
        if self.anchors is not None:
            return self.anchors
        if self.adds:  # an attribute added to a class relies on how that class uses it
            owner, _, _ = self.attr.rpartition(".")
            return (f"{self.module}:{owner}",) if owner else ()
        return (f"{self.module}:{self.attr}",)


class ArgSlots:
    """Where named parameters of a vLLM function sit in ``(*args, **kwargs)``, read once from its signature, so
    a keyword vLLM adds later passes through. A parameter the signature lacks fails the patch at prepare."""

    def __init__(self, fn: Callable[..., Any], names: Sequence[str], *, bound: bool = False) -> None:
        params = list(inspect.signature(fn).parameters.values())
        if bound:
            params = params[1:]
        by_name = {p.name: (i, p) for i, p in enumerate(params)}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise PatchError(f"{getattr(fn, '__qualname__', fn)!r} has no parameter(s) {missing}")
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.position = {n: by_name[n][0] for n in names if by_name[n][1].kind in positional}
        self.default = {
            n: (None if by_name[n][1].default is inspect.Parameter.empty else by_name[n][1].default) for n in names
        }
        self._plan = tuple((n, self.position.get(n, -1), self.default[n]) for n in names)

    def read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Every name given at construction, in order, in one call (a hook pays per call)."""
        count = len(args)
        out = []
        for name, i, default in self._plan:
            if name in kwargs:
                out.append(kwargs[name])
            elif 0 <= i < count:
                out.append(args[i])
            else:
                out.append(default)
        return out

    def get(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self.position.get(name)
        if i is not None and i < len(args):
            return args[i]
        return self.default[name]

    def replace(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        i = self.position.get(name)
        if name not in kwargs and i is not None and i < len(args):
            return (*args[:i], value, *args[i + 1 :]), kwargs
        return args, {**kwargs, name: value}


@dataclass
class _Applied:
    patch: Patch
    owner: Any
    name: str
    original: Any
    """Raw value in ``owner.__dict__`` before install, or ``_MISSING`` when inherited."""
    replacement: Any
    armable: ArmedEntry | None = None
    """An armable patch's: its target holds the replacement only once armed."""


def resolve_owner(module: ModuleType, attr: str) -> tuple[Any, str]:
    *path, name = attr.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _raw(owner: Any, name: str) -> Any:
    return owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING


def require_parameters(original: Any, names: tuple[str, ...], patch: str) -> None:
    """Refuse a target whose parameters differ from the hook's (else a ``TypeError`` on every call)."""
    try:
        found = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError) as exc:
        raise PatchError(f"patch {patch!r}: cannot read the parameters of {original!r} ({exc})") from exc
    if found != names:
        raise PatchError(f"patch {patch!r}: the target takes {found}, the hook is written for {names}")


def _mark(replacement: Any, patch: Patch, original: Any) -> Any:
    target = replacement.__func__ if isinstance(replacement, (staticmethod, classmethod)) else replacement
    for key, value in ((PATCH_MARK, patch.name), ("__wrapped__", original)):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(target, key, value)
    return replacement


def _shielded(patch: Patch, replacement: Any, original: Any) -> Any:
    """Never raises on a microbatch thread."""
    if isinstance(replacement, MicrobatchAttr):
        replacement.where = patch.name
        return replacement
    if getattr(replacement.fget if isinstance(replacement, property) else replacement, SHIELDS_ITSELF, False):
        return replacement
    if isinstance(replacement, property) and replacement.fget is not None:
        fget = shield(replacement.fget, original.fget, patch.name)
        return property(fget, replacement.fset, replacement.fdel, replacement.__doc__)
    if callable(replacement) and not isinstance(replacement, type):
        if original is None:
            raise PatchError(f"patch {patch.name!r} runs on microbatch threads but has no fallback")
        return shield(replacement, original, patch.name)
    raise PatchError(f"patch {patch.name!r} runs on microbatch threads but {type(replacement).__name__} cannot be shielded")


@dataclass
class PatchStatus:
    patch: Patch
    state: str
    """``installed``, ``pending`` (lazy, module not imported yet), ``skipped`` (optional, missing),
    ``broken`` (lazy, failed when its module was imported), ``missing``."""
    detail: str = ""


def _notify(kind: str, listeners: Sequence[Callable[..., object]], *args: Any) -> None:
    for listener in listeners:
        try:
            listener(*args)
        except Exception as exc:  # a listener must never break vLLM's import or an armed run
            logger.debug("dbo_runtime: %s listener failed: %r", kind, exc)


class _LazyFinder(importlib.abc.MetaPathFinder):
    """Applies a PatchSet's lazy patches right after their module executes."""

    def __init__(self, owner: PatchSet) -> None:
        self.owner = owner
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if not any(p.module == fullname for p in self.owner._lazy_waiting) or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        owner = self.owner

        class _Loader(importlib.abc.Loader):
            # everything but execution is the original loader's (source, resources, pickling); not ``get_code``,
            # through which ``runpy`` would execute the module without its patches
            def __getattr__(self, name: str) -> Any:
                if name == "get_code":
                    raise AttributeError(name)
                return getattr(loader, name)

            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                owner._apply_lazy(module)

        spec.loader = _Loader()
        return spec


class Instrument(Protocol):
    """Wraps replacements at install time (``selftime``)."""

    def pause_for_original(self, original: Any) -> Any: ...

    def time_plugin(self, fn: Any, name: str) -> Any: ...


class PatchSet:
    """All-or-nothing installation of a list of ``Patch`` (``instrument``: wraps every replacement when given)."""

    def __init__(self, patches: Iterable[Patch], *, instrument: Instrument | None = None) -> None:
        self.patches = list(patches)
        self.instrument = instrument
        names = [p.name for p in self.patches]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise PatchError(f"duplicate patch names: {sorted(dup)}")
        self._applied: list[_Applied] = []
        self._lazy_waiting: list[Patch] = []
        self._skipped: dict[str, str] = {}
        self._broken: dict[str, str] = {}
        self._finder: _LazyFinder | None = None
        self._lock = threading.RLock()
        self.installed = False
        self.lazy_listeners: list[Callable[[str], object]] = []
        """Called (module name) after a lazy module's patches were applied."""
        self.failure_listeners: list[Callable[[list[Patch], str], None]] = []
        """Called (patches, message) when a lazy module's required patches could not be applied."""

    def _prepare(self, patch: Patch, module: ModuleType) -> _Applied:
        owner, name = resolve_owner(module, patch.attr)
        current = getattr(owner, name, None) if patch.adds else getattr(owner, name)
        raw = _raw(owner, name)
        given = raw if raw is not _MISSING else current
        instrument = self.instrument
        if instrument is not None and not patch.adds:
            given = instrument.pause_for_original(given)
        replacement = patch.make(given)
        if patch.runs_on_ubatch_thread:
            replacement = _shielded(patch, replacement, given)
        if instrument is not None:
            replacement = instrument.time_plugin(replacement, patch.name)
        return _Applied(patch, owner, name, raw, _mark(replacement, patch, current))

    def _set(self, applied: _Applied) -> None:
        """Apply one patch, or leave its target as it was (a failing hook is undone here; callers undo the rest)."""
        if applied.patch.armed_at_first_microbatch:
            applied.armable = ArmedEntry(
                applied.patch.name, arm=lambda: self._arm(applied), on_failure=lambda message: self._arm_failed(applied.patch, message)
            )
            ARMING.register(applied.armable)
        else:
            setattr(applied.owner, applied.name, applied.replacement)
        if applied.patch.on_install is not None:
            try:
                applied.patch.on_install()
            except BaseException:
                self._rollback([applied])
                raise

    @staticmethod
    def _arm(applied: _Applied) -> None:
        """Set an armable patch's replacement, only over the original it was built around."""
        if _raw(applied.owner, applied.name) is not applied.original:
            raise PatchError(f"{applied.patch.target} was rebound after dbo_runtime installed {applied.patch.name}")
        setattr(applied.owner, applied.name, applied.replacement)

    def _arm_failed(self, patch: Patch, message: str) -> None:
        """An armed patch's target could not be set: it is broken; the listeners hear it once (arming is retried)."""
        with self._lock:
            if patch.name in self._broken:
                return
            self._broken[patch.name] = message
            listeners = list(self.failure_listeners)
        _notify("failure", listeners, [patch], f"dbo_runtime: {message}")

    @staticmethod
    def _restore(applied: _Applied) -> None:
        if applied.original is _MISSING:
            delattr(applied.owner, applied.name)
        else:
            setattr(applied.owner, applied.name, applied.original)

    @classmethod
    def _unset(cls, applied: _Applied) -> None:
        armable, applied.armable = applied.armable, None
        # withdrawn from ARMING first; its target holds the original unless armed
        if armable is None or ARMING.unregister(armable):
            cls._restore(applied)
        if applied.patch.on_uninstall is not None:
            applied.patch.on_uninstall()

    @classmethod
    def _rollback(cls, applied: list[_Applied]) -> None:
        """Undo ``applied`` newest first; a patch that cannot be undone is logged, the others go on."""
        for item in reversed(applied):
            try:
                cls._unset(item)
            except Exception as exc:
                logger.error("dbo_runtime: undoing patch %s failed (%r); its target may stay patched", item.patch.name, exc)

    def install(self) -> None:
        """Apply every patch whose module is loaded, arm the lazy rest, or change nothing at all. Lazy patches
        whose module an eager import loaded join the transaction; the others wait for the import hook."""
        with self._lock:
            if self.installed:
                return
            prepared: list[_Applied] = []
            skipped: dict[str, str] = {}
            for patch in (p for p in self.patches if not p.lazy):
                self._prepare_into(patch, None, prepared, skipped)
            lazy: list[Patch] = []
            for patch in (p for p in self.patches if p.lazy):
                loaded = sys.modules.get(patch.module)
                if loaded is None:
                    lazy.append(patch)
                else:
                    self._prepare_into(patch, loaded, prepared, skipped)
            self._applied = self._set_all(prepared, skipped)
            self._lazy_waiting = lazy
            self._skipped = skipped
            self.installed = True
            if lazy:
                self._finder = _LazyFinder(self)
                sys.meta_path.insert(0, self._finder)
            for name, why in skipped.items():
                logger.info("dbo_runtime: optional patch %s skipped (%s)", name, why)

    def _set_all(self, prepared: list[_Applied], skipped: dict[str, str]) -> list[_Applied]:
        """The required patches all or none (else ``PatchError``), then each optional one alone (a failure skips it)."""
        done: list[_Applied] = []
        for item in (item for item in prepared if not item.patch.optional):
            try:
                self._set(item)
            except BaseException as exc:  # KeyboardInterrupt too: never leave unrecorded patches behind
                self._rollback(done)
                if not isinstance(exc, Exception):
                    raise
                raise PatchError(f"patch {item.patch.name!r} failed to apply: {exc!r}; rolled back") from exc
            done.append(item)
        for item in (item for item in prepared if item.patch.optional):
            try:
                self._set(item)
            except Exception as exc:
                skipped[item.patch.name] = f"{type(exc).__name__}: {exc}"
            else:
                done.append(item)
        return done

    def _prepare_into(
        self, patch: Patch, module: ModuleType | None, prepared: list[_Applied], skipped: dict[str, str]
    ) -> None:
        """Prepare one patch; optional ones may be skipped."""
        try:
            target = module if module is not None else (sys.modules.get(patch.module) or importlib.import_module(patch.module))
            prepared.append(self._prepare(patch, target))
        except Exception as exc:
            if not patch.optional:
                raise PatchError(f"patch {patch.name!r} ({patch.target}) cannot be prepared: {exc!r}") from exc
            skipped[patch.name] = f"{type(exc).__name__}: {exc}"

    def _apply_lazy(self, module: ModuleType) -> None:
        """A lazy module finished importing: patch all of it or none. A failure marks its patches ``broken``; it
        fails the import under ``DBO_RUNTIME_STRICT=1``, and on a microbatch thread the step after the join, STRICT
        or not (the guard judged at load; the step would go on unpatched)."""
        with self._lock:
            if not self.installed:
                return
            todo = [p for p in self._lazy_waiting if p.module == module.__name__]
            prepared: list[_Applied] = []
            failure: BaseException | None = None
            try:
                for patch in todo:
                    self._prepare_into(patch, module, prepared, self._skipped)
            except PatchError as exc:
                failure = exc.__cause__ or exc
            self._lazy_waiting = [p for p in self._lazy_waiting if p not in todo]
            if failure is None:
                try:
                    self._applied.extend(self._set_all(prepared, self._skipped))
                except PatchError as exc:
                    failure = exc.__cause__ or exc
            required = [p for p in todo if not p.optional or p.name not in self._skipped]
            if failure is not None:
                for patch in required:
                    self._broken[patch.name] = f"{type(failure).__name__}: {failure}"
            listeners = list(self.lazy_listeners) if failure is None else []
            failed = list(self.failure_listeners) if failure is not None else []
        if failure is None:
            _notify("lazy", listeners, module.__name__)
            return
        names = ", ".join(p.name for p in required)
        message = f"dbo_runtime: patches for {module.__name__} ({names}) cannot be applied ({failure!r}); none of them is installed"
        _notify("failure", failed, required, message)
        error = PatchError(message)
        error.__cause__ = failure
        if record(f"lazy patches for {module.__name__}", error):  # STRICT or not: the join point raises it
            return
        if parse_switch("DBO_RUNTIME_STRICT"):
            raise error
        logger.error("%s", message)

    def uninstall(self) -> None:
        """Restore every original object, newest first."""
        with self._lock:
            if self._finder is not None:
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(self._finder)
                self._finder = None
            applied, self._applied = self._applied, []
            self._rollback(applied)
            self._lazy_waiting = []
            self._skipped = {}
            self._broken = {}
            self.installed = False

    def status(self) -> list[PatchStatus]:
        with self._lock:
            applied = {a.patch.name for a in self._applied}
            waiting = {p.name for p in self._lazy_waiting}
            out = []
            for patch in self.patches:
                if patch.name in self._broken:  # a lazy module that failed, or an armed patch that could not be set
                    out.append(PatchStatus(patch, "broken", self._broken[patch.name]))
                elif patch.name in applied:
                    out.append(PatchStatus(patch, "installed"))
                elif patch.name in waiting:
                    out.append(PatchStatus(patch, "pending", "module not imported yet"))
                elif patch.name in self._skipped:
                    out.append(PatchStatus(patch, "skipped", self._skipped[patch.name]))
                else:
                    out.append(PatchStatus(patch, "missing" if self.installed else "not installed"))
            return out


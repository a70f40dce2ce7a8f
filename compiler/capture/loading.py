"""Build the model a plan names: `path/file.py:Class` (relative to the plan) or `pkg.mod:Class`.

Compile never needs real weights, so the compiler builds the model on the meta
device; the runtime builds it on CPU. Building on CPU is deterministic: weights
are drawn under `plan.train.seed` without disturbing the caller's RNG, so every
rank and the single-process reference get the same initial model.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from .budget import Budget, OverBudget
from .constructor import Copies, Watch
from .model_checks import check_model_against_plan


def load_model(plan: Plan, device: str = "meta") -> torch.nn.Module:
    """The plan's model, constructed with `plan.model.args` on `device` ("meta" or "cpu").

    On meta, a constructor that reads a value of a tensor it computed (the stochastic-depth
    idiom `torch.linspace(0, rate, depth).tolist()`, an `.item()`: no meta tensor has values)
    fails; it is built again with only its parameters on meta, as the runtime builds it
    (`load_skeleton`: every other tensor computed on CPU, bounded by the same budget),
    then its buffers and tensor attributes moved to meta. A constructor that fails that way
    too is reported with that error, the one it raises on CPU."""
    copies = Copies()
    if device != "meta":
        model = _construct(plan, lambda: torch.device(device))
    else:
        try:
            model = _construct(plan, lambda: _on_meta(copies))
        except PlanError as e:
            if e.__cause__ is None:  # stopped by the budget, or not the constructor's error
                raise
            copies = Copies()
            model = _construct(plan, lambda: _values_on_cpu(copies))
            _tensors_to_meta(model)
        copies.found(model)
        _parameters_to_meta(model)
    check_model_against_plan(plan, model)
    return model


@contextlib.contextmanager
def _values_on_cpu(copies: Copies):
    """The meta build for a constructor that reads values: parameters moved to meta as
    they are registered (`_parameters_on_meta`), every other tensor computed on CPU, each
    factory call sized on meta first by the budget (nothing allocated past a bound)."""
    with Budget(real=True) as budget, _MetaBuild(budget, copies), \
            _parameters_on_meta(watch=False):
        yield budget


def _tensors_to_meta(model: torch.nn.Module) -> None:
    """Buffers and plain tensor attributes (what the meta build makes meta) to meta."""
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type != "meta":
                module._buffers[name] = b.to("meta")
        for name, value in list(vars(module).items()):
            if type(value) is torch.Tensor and value.device.type != "meta":
                setattr(module, name, value.to("meta"))


def _parameters_to_meta(model: torch.nn.Module) -> None:
    """Every parameter on meta (a tied one stays one). Not every factory obeys the meta
    device's context: `torch.normal(mean, std, size=...)` and `torch.from_numpy` make CPU
    tensors, so DiffLlama's constructor-drawn lambdas were real values in the stages the
    ranks compile, which kept them instead of drawing them by the model's init rule as the
    reference does (backends/state/model.fill_stages fills only meta parameters): every
    rank trained from other initial lambdas."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type != "meta":
                module._parameters[name] = moved.setdefault(id(p), torch.nn.Parameter(
                    p.detach().to("meta"), requires_grad=p.requires_grad))


# In-place initialisers: shape, dtype and device preserved, only values written.
_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "constant_", "fill_", "zero_",
                    "ones_", "zeros_", "eye_", "dirac_", "orthogonal_", "sparse_",
                    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                    "exponential_", "random_", "bernoulli_", "log_normal_", "cauchy_",
                    "geometric_"})


class _MetaBuild(torch.overrides.TorchFunctionMode):
    """A meta tensor has no values to fill: initialisers return it as it is. (Running them
    goes through torch's Python reference kernels, whose first call imports torch._dynamo:
    ~2 s of every rank's start-up.) Every other call goes through the construction budget
    (budget.py), in this one mode: a second would double the cost per call."""

    def __init__(self, budget: Budget, copies: Copies):
        super().__init__()
        self.budget, self.copies = budget, copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _FILLS:
            t = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(t, torch.Tensor) and t.is_meta:
                self.copies.filled(name, t)
                return t
        out = self.budget.call(func, args, kwargs)
        self.copies.called(name, args, out)
        return out


@contextlib.contextmanager
def _on_meta(copies: Copies):
    """Build on meta, bounded (budget.py), the copies of drawn parameters recorded
    (constructor.Copies); yields the Budget."""
    with torch.device("meta"), Budget() as budget, _MetaBuild(budget, copies):
        yield budget


def _construct(plan: Plan, context) -> torch.nn.Module:
    """`cls(**plan.model.args)` (a model folder: its config, the args overriding config
    fields) under the plan's seed inside `context()`; a failing constructor (an exception
    or sys.exit) is a PlanError at the model's args."""
    if is_folder_source(plan.model.source):
        cls, args = folder_model(plan), {}
    else:
        cls = resolve_model_class(plan)
        args = dict(plan.model.args)
        _check_args(plan, cls, args)
    try:
        with torch.random.fork_rng(devices=[]), context() as budget:
            torch.manual_seed(plan.train.seed)
            model = cls(**args)
            if isinstance(budget, Budget):
                budget.check()  # what the constructor's last line created
    except OverBudget as e:  # stopped at once: the args scale the model past a bound
        raise PlanError.at(plan, "model.args", f"{cls.__name__}({_fmt_args(args)}) was stopped "
                           f"while it was being built: {e.counts.describe()} so far, "
                           f"{e.what}; nothing was started",
                           "make the model smaller (model.args), or build large buffers in "
                           "forward or as parameters (docs/runtime.md, Trust)") from None
    except (Exception, SystemExit) as e:  # the user's constructor failed: point at the args
        raise PlanError.at(plan, "model.args", f"{cls.__name__}({_fmt_args(args)}) failed: "
                           f"{type(e).__name__}: {e}", _READS_A_PARAMETER if "meta tensor" in
                           str(e) else "check the constructor arguments against the model's "
                           "__init__") from e
    if not isinstance(model, torch.nn.Module):
        raise PlanError.at(plan, "model.source", f"{cls.__name__} returned "
                           f"{type(model).__name__}, not a torch.nn.Module")
    return model


# A constructor that still reads a meta tensor's value with only its parameters on meta
# (load_model's second build) reads one of its parameters (torch's orthogonal
# parametrization checks the weight it is registered on).
_READS_A_PARAMETER = ("the constructor reads the value of one of its parameters: pipeplan builds "
                      "parameters without values (on the meta device) and draws them per "
                      "module afterwards; compute what the constructor reads from constants, "
                      "or read it in forward (docs/runtime.md, Initial weights)")


def resolve_model_class(plan: Plan):
    """The class (or factory function returning a module) named by plan.model.source."""
    source = plan.model.source
    where, sep, name = source.rpartition(":")
    if not sep or not where or not name:
        raise PlanError.at(plan, "model.source", f"model source {source!r} has no class name",
                           'write "path/to/file.py:ClassName" or "package.module:ClassName"')
    module = _import_source(plan, where)
    cls = getattr(module, name, None)
    if not callable(cls):
        candidates = [k for k, v in vars(module).items()
                      if isinstance(v, type) and issubclass(v, torch.nn.Module)
                      and v.__module__ == module.__name__]
        close = difflib.get_close_matches(name, candidates, n=1)
        hint = (f"did you mean {close[0]!r}?" if close else
                f"classes defined there: {', '.join(sorted(candidates)) or 'none'}")
        raise PlanError.at(plan, "model.source", f"no class {name!r} in {where}", hint)
    return cls


def model_source_file(plan: Plan) -> Path | None:
    """The file defining the plan's model (for the build manifest's hash), if there is one:
    a model folder's config.json."""
    if is_folder_source(plan.model.source):
        path = model_folder(plan) / "config.json"
        return path if path.is_file() else None
    where = plan.model.source.rpartition(":")[0]
    if is_path_source(where):
        path = _resolve_path(plan, where)
        return path if path.is_file() else None
    try:
        spec = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


# ------------------------------------------------------------- a model folder
def is_folder_source(source: str) -> bool:
    """`source = "FOLDER"` (or ".../config.json"): a Hugging Face model folder (the schema
    admits no other source without a `:Class`)."""
    return ":" not in source


def model_folder(plan: Plan) -> Path:
    path = _resolve_path(plan, plan.model.source)
    return path.parent if path.name == "config.json" else path


def folder_config(plan: Plan) -> dict | None:
    """A model folder's config.json as plain JSON (no transformers), or None."""
    try:
        with open(model_folder(plan) / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def folder_model(plan: Plan):
    """A function building the folder's model from its config.json with random weights
    (transformers' AutoModelForCausalLM.from_config; model.weights loads the folder's
    weights). model.args override config fields; the KV cache is off (training)."""
    folder = model_folder(plan)
    if not (folder / "config.json").is_file():
        raise PlanError.at(plan, "model.source", f"model folder {folder} has no config.json"
                           if folder.is_dir() else f"model folder {folder} does not exist",
                           "name a folder written by save_pretrained (it holds config.json), "
                           "or a model file: source = \"file.py:Class\"")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise PlanError.at(plan, "model.source", "a model folder is built by transformers, "
                           "which is not installed", "pip install transformers") from None
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers raises ValueError, OSError, KeyError, ...
        raise PlanError.at(plan, "model.source", f"{folder}/config.json is not a transformers "
                           f"config: {type(e).__name__}: {e}") from None
    for key, value in plan.model.args.items():
        if not hasattr(config, key):
            close = difflib.get_close_matches(key, list(config.to_dict()), n=1)
            raise PlanError.at(plan, f"model.args.{key}", f"{type(config).__name__} has no "
                               f"field {key!r}", f"did you mean {close[0]!r}?" if close else
                               "model.args of a model folder override its config.json fields")
        setattr(config, key, list(value) if isinstance(value, tuple) else value)
    config.use_cache = False

    def build():
        return AutoModelForCausalLM.from_config(config)

    build.__name__ = (config.architectures or [type(config).__name__])[0]
    return build


def is_path_source(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _resolve_path(plan: Plan, where: str) -> Path:
    return Path(plan.resolve_path(where, "model.source")).resolve()


def _import_source(plan: Plan, where: str) -> ModuleType:
    if is_path_source(where):
        path = _resolve_path(plan, where)
        if not path.is_file():
            raise PlanError.at(plan, "model.source", f"model file not found: {path}",
                               "paths are relative to the plan file's folder")
        return _import_file(plan, path)
    try:
        with _import_guard(plan, where):
            return importlib.import_module(where)
    except ImportError as e:
        raise PlanError.at(plan, "model.source", f"cannot import module {where!r}: {e}",
                           "use a dotted module path importable here, or a file path ending in .py"
                           ) from e


def _import_file(plan: Plan, path: Path) -> ModuleType:
    """Import a model file as part of its package when it has one (relative imports work)."""
    dotted, top = _package_name(path)
    try:
        with _import_guard(plan, str(path)):
            return _exec_file(path, dotted, top)
    except PlanError:
        raise
    except Exception as e:
        sys.modules.pop(f"pipeplan_model_{abs(hash(str(path)))}", None)
        raise PlanError.at(plan, "model.source", f"importing {path} failed: "
                           f"{type(e).__name__}: {e}") from e


def _exec_file(path: Path, dotted: str | None, top: Path | None) -> ModuleType:
    if dotted is None:
        name = f"pipeplan_model_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module
    if str(top.parent) not in sys.path and not _known_package(top):
        sys.path.insert(0, str(top.parent))
    return importlib.import_module(dotted)


@contextlib.contextmanager
def _import_guard(plan: Plan, what: str):
    """Import the user's model code as a library: with sys.argv holding only the file (so
    pipeplan's own arguments are not parsed as the model's), and an exit at import reported
    at the plan's model.source line instead of ending pipeplan (SystemExit is no Exception;
    os._exit is caught here too, or `pipeplan check` would end with its code and no word:
    a silent exit 0 would read as success)."""
    argv, err, exited, hard_exit = sys.argv, io.StringIO(), False, os._exit
    sys.argv = [what]
    os._exit = _refuse_os_exit
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as e:
        exited = True
        said = [line for line in err.getvalue().splitlines() if line.strip()]
        if any(line.startswith("usage:") for line in said):
            kind = "parses command-line arguments at import and exits"
        elif isinstance(e, _OsExit):
            kind = f"calls os._exit({e.code!r}) at import"
        else:
            kind = f"calls sys.exit({e.code!r}) at import"
        raise PlanError.at(plan, "model.source", f"{what} {kind}"
                           + (f": {said[-1].strip()}" if said else ""),
                           "a model file is imported as a library: move script code (argument "
                           "parsing, sys.exit) under `if __name__ == \"__main__\":`") from None
    finally:
        sys.argv, os._exit = argv, hard_exit
        if not exited:
            sys.stderr.write(err.getvalue())  # what the import printed (warnings) still shows


class _OsExit(SystemExit):
    """os._exit called by a model module while pipeplan imports it."""


def _refuse_os_exit(code: int) -> None:
    raise _OsExit(code)


def _package_name(path: Path) -> tuple[str | None, Path | None]:
    """The dotted module name of `path` inside its package tree, or (None, None) if standalone."""
    parts, top, d = [path.stem], None, path.parent
    while (d / "__init__.py").is_file():
        parts.insert(0, d.name)
        top, d = d, d.parent
    if top is None:
        return None, None
    known = _known_package(top)
    if known:  # e.g. the repo folder is imported as `pipeplan`, not by its folder name
        parts[0] = known
    return ".".join(parts), top


def _known_package(folder: Path) -> str | None:
    for name, mod in list(sys.modules.items()):
        if "." not in name and any(Path(p).resolve() == folder.resolve()
                                   for p in getattr(mod, "__path__", None) or ()):
            return name
    return None


def _check_args(plan: Plan, cls: type, args: dict) -> None:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**args)
    except TypeError as e:
        params = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
        bad = [k for k in args if k not in sig.parameters]
        key = f"model.args.{bad[0]}" if bad else "model.args"
        close = difflib.get_close_matches(bad[0], params, n=1) if bad else []
        hint = (f"did you mean {close[0]!r}? " if close else "") + \
            f"{cls.__name__} takes: {', '.join(params)}"
        raise PlanError.at(plan, key, f"wrong arguments for {cls.__name__}: {e}", hint) from e


def _fmt_args(args: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


# --------------------------------------------------------------------------- init
# The runtime never builds the whole model with weights: `load_skeleton` constructs it
# with every parameter on the meta device and every buffer where the constructor computed
# it (CPU), and backends/state/materialize.py initialises only the modules a rank owns, each by
# the model's own per-module rule (compiler/capture/init_rules.py says which, and
# `check_init` there proves it covers every parameter) under a seed derived from the
# module's path.


def load_skeleton(plan: Plan) -> torch.nn.Module:
    """The plan's model with its parameters on the meta device (nothing allocated) and its
    buffers computed on CPU by the constructor (rotary inv_freq, causal masks); what the
    constructor did to each parameter is read back by constructor.py."""
    build = _parameters_on_meta()
    model = _construct(plan, lambda: build)
    build.watch.found(model)
    return model


class _parameters_on_meta:
    """While active, every parameter a module registers is moved to the meta device at
    once, so the init the constructor runs on it afterwards costs nothing (the trick of
    accelerate's `init_empty_weights(include_buffers=False)`), under constructor.Watch
    (`watch`: the skeleton's records; load_model's second build reads none)."""

    def __init__(self, watch: bool = True):
        self.watch = Watch() if watch else None

    def __enter__(self):
        self._orig = orig = torch.nn.Module.register_parameter
        watch = self.watch

        def register_parameter(module, name, param):
            orig(module, name, param)
            if param is not None and param.device.type != "meta":
                moved = module._parameters[name] = torch.nn.Parameter(
                    param.to("meta"), requires_grad=param.requires_grad)
                if watch is not None:
                    watch.register(param, moved)

        torch.nn.Module.register_parameter = register_parameter
        if watch is not None:
            watch.__enter__()
        return self

    def __exit__(self, *exc):
        if self.watch is not None:
            self.watch.__exit__(*exc)
        torch.nn.Module.register_parameter = self._orig
        return False

"""The PEFT adapters a model carries, by name, and each submission's choice among them (docs/adapters.md).

The adapters are read from the model's own PEFT layers (transformers' `add_adapter` / `load_adapter`, or a
`peft.PeftModel`'s), never copied: every adapter a layer holds is known by its name, with the method that
holds it. A LoRA adapter (DoRA included) held only by PEFT's LoRA `Linear` layers can run per request: the
runner splits those layers' rows by adapter (runner/adapter_rows.py). Every other adapter (IA³, `modules_to_save`,
LoRA on an embedding or a convolution, a quantized layer's LoRA, a LoRA variant other than DoRA) is refused
per request by name; it still runs as the model's active adapter.

A request's choice (`resolve`):

- `adapter="name"`: that adapter (its weight version salts its page keys);
- `adapter=None`: the base model, no adapter at all (as `with model.disable_adapter()` gives);
- no `adapter=` (`UNSET`): today's behaviour, the model's active adapter(s) as they are at submission, as
  if named (or the base model when its adapters are disabled); None (the model's own forwards, unsplit)
  when the model has no adapter or its active one cannot run per request.

A named choice (or `adapter=None`) needs every other PEFT layer idle: none merged, none of the refused
methods active (they would apply to every row).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from torch import nn

from ...requests import AdapterChoice
from ...runner.adapter_rows import lora_linear_class


class Unset:
    """The type of `UNSET`: no `adapter=` given (the model's active adapter runs)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()  # a submission that gives no `adapter=`

PER_REQUEST_VARIANTS = {"DoraLinearVariant": "DoRA"}


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter the model carries: its method, and why it cannot run per request (None: it can)."""

    name: str
    method: str
    refusal: str | None = None


@dataclass
class _Layers:
    """A scan of the model's PEFT layers: every adapter, and what the other layers apply now."""

    adapters: dict[str, AdapterInfo]
    splittable: list[nn.Module]  # PEFT's LoRA Linears
    others: list[tuple[nn.Module, frozenset[str]]]  # every other PEFT layer, with the adapters it holds


def _method_of(module: nn.Module) -> str:
    path = type(module).__module__.split(".")
    if len(path) > 2 and path[:2] == ["peft", "tuners"]:
        return path[2].upper() if path[2] != "lora" else "LoRA"
    return type(module).__name__


def _held(module: nn.Module) -> frozenset[str]:
    """The adapters a PEFT layer holds: the keys of its adapter dicts (`modules_to_save` for a wrapper)."""
    names: set[str] = set()
    for attribute in (*getattr(module, "adapter_layer_names", ()), "modules_to_save"):
        held = getattr(module, attribute, None)
        if isinstance(held, (nn.ModuleDict, nn.ParameterDict, dict)):
            names.update(str(key) for key in held)
    return frozenset(names)


def _is_peft_layer(module: nn.Module) -> bool:
    return "_active_adapter" in module.__dict__ or hasattr(module, "original_module")


def _active(module: nn.Module) -> tuple[tuple[str, ...], bool]:
    active = module.__dict__.get("_active_adapter", ())
    names = (active,) if isinstance(active, str) else tuple(active or ())
    return names, bool(module.__dict__.get("_disable_adapters", False))


def scan(model: nn.Module) -> _Layers:
    """Every PEFT layer of `model` and the adapters they hold."""
    lora_linear = lora_linear_class()
    infos: dict[str, AdapterInfo] = {}
    splittable: list[nn.Module] = []
    others: list[tuple[nn.Module, frozenset[str]]] = []

    def note(name: str, method: str, refusal: str | None) -> None:
        known = infos.get(name)
        if known is None or (known.refusal is None and refusal is not None):
            infos[name] = AdapterInfo(name, method if known is None else known.method, refusal)

    for module in model.modules():
        if not _is_peft_layer(module):
            continue
        held = _held(module)
        if lora_linear is not None and type(module) is lora_linear:
            splittable.append(module)
            variants: dict[str, object] = getattr(module, "lora_variant", {})
            for name in held:
                variant = variants.get(name)
                kind = type(variant).__name__ if variant is not None else None
                if kind is None:
                    note(name, "LoRA", None)
                elif kind in PER_REQUEST_VARIANTS:
                    note(name, PER_REQUEST_VARIANTS[kind], None)
                else:
                    note(name, f"LoRA ({kind})", f"its LoRA variant {kind} is not split per request")
            continue
        method = "modules_to_save" if hasattr(module, "original_module") else _method_of(module)
        others.append((module, held))
        for name in held:
            note(name, method, f"it uses {method} on {type(module).__name__} layers")
    return _Layers(infos, splittable, others)


class AdapterRegistry:
    """The engine's view of its model's adapters: their names and weight versions, each submission's
    choice. Scanned on first use, again when a name is unknown (an adapter added since) or `refresh()`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.versions: dict[str, int] = {}  # an adapter's in-place updates (`bump`)
        self._layers: _Layers | None = None
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Forget the scan (adapters added, deleted or loaded since): the next question scans again."""
        with self._lock:
            self._layers = None

    def _scan(self, again: bool = False) -> _Layers:
        with self._lock:
            if self._layers is None or again:
                self._layers = scan(self.model)
            return self._layers

    def adapters(self) -> dict[str, AdapterInfo]:
        """Every adapter the model carries, by name."""
        return dict(self._scan(again=True).adapters)

    def mixing_problem(self) -> str | None:
        """Why requests that chose their adapter cannot run now (scanned again: called after a weight change
        that may have merged an adapter or made another method active), or None."""
        return _mixing_problem(self._scan(again=True))

    def bump(self, name: str) -> int:
        """`name`'s weights were updated in place: its new version (its later requests never hit the pages
        of the version before)."""
        self.versions[name] = self.versions.get(name, 0) + 1
        return self.versions[name]

    def resolve(self, adapter: object, label: str) -> AdapterChoice | None:
        """A submission's `adapter=` as the request's choice; `ValueError` naming `label` and the adapter."""
        layers = self._scan()
        if adapter is UNSET:
            return self._active_choice(layers)
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(f"{label}: adapter must be an adapter's name (a str) or None, not {adapter!r}")
        if adapter is not None and adapter not in layers.adapters:
            layers = self._scan(again=True)  # added since the last scan?
        if not layers.adapters and not layers.others:
            if adapter is None:
                return None  # a model without adapters: the base model is the model
            raise ValueError(f"{label}: unknown adapter {adapter!r}: the model carries no PEFT adapter")
        if adapter is not None:
            info = layers.adapters.get(adapter)
            if info is None:
                raise ValueError(
                    f"{label}: unknown adapter {adapter!r}; the model's adapters: "
                    f"{sorted(layers.adapters)} (adapter=None: the base model)"
                )
            if info.refusal is not None:
                raise ValueError(
                    f"{label}: adapter {adapter!r} ({info.method}) cannot run per request: {info.refusal}; "
                    "only LoRA (and DoRA) adapters on Linear layers can (docs/adapters.md). Make it the "
                    "active adapter (set_adapter) and submit without adapter="
                )
        problem = _mixing_problem(layers)
        if problem is not None:
            raise ValueError(f"{label}: adapter={adapter!r} cannot be applied per request: {problem}")
        names = () if adapter is None else (adapter,)
        return AdapterChoice(names, self.versions.get(adapter, 0) if adapter is not None else 0)

    def _active_choice(self, layers: _Layers) -> AdapterChoice | None:
        """The model's active adapters as a choice, or None (its own forwards) when they cannot be split."""
        if not layers.splittable or _mixing_problem(layers) is not None:
            return None
        names, disabled = _active(layers.splittable[0])
        if any(_active(layer) != (names, disabled) for layer in layers.splittable):
            return None  # layers set apart (a per-layer set_adapter): their own forwards
        if disabled:
            return AdapterChoice(())
        infos = [layers.adapters.get(name) for name in names]
        if any(info is None or info.refusal is not None for info in infos):
            return None
        return AdapterChoice(names, max((self.versions.get(name, 0) for name in names), default=0))


def _mixing_problem(layers: _Layers) -> str | None:
    """Why rows on different adapters cannot share a step now: a merged adapter (in the base weights of
    every row), or another PEFT layer applying an adapter to every row."""
    for module in [*layers.splittable, *(m for m, _ in layers.others)]:
        merged = tuple(getattr(module, "merged_adapters", ()) or ())
        if merged:
            return f"adapter(s) {list(merged)} are merged into the base weights (unmerge them first)"
    for module, held in layers.others:
        names, disabled = _active(module)
        applied = [name for name in names if name in held]
        if not disabled and applied:
            return (
                f"the model applies adapter(s) {applied} through {type(module).__name__} layers, which cannot "
                "be split per request (disable them, or set_adapter to a LoRA adapter)"
            )
    return None

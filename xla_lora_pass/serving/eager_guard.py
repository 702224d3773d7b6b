"""The eager guard: a LoRA layer that computes the wrong adapters inside a compiled call raises.

Inside a call of a ``torch.compile``d model, a LoRA layer (or a saved module)
that Dynamo did not put in a graph runs eagerly: after a graph break, or when
Dynamo falls back to eager (past its recompile limit).  It then computes its
active adapter for every token, whatever the mapping says.  Outside every
compiled call (``set_adapter``, ``disable_adapter``, PEFT's ``adapter_names=``,
``torch.compile(model).generate(...)``, which runs the uncompiled module) the
model is plain PEFT and keeps PEFT's behaviour.

How the two are told apart (``inside_compiled_call``): Dynamo installs its
eval-frame callback for the whole of a compiled call and removes it after.
Measured on torch 2.9: outside any compiled call the callback is None; in a
compiled call it is Dynamo's callback (also while the code after a graph
break runs), or ``False`` when Dynamo runs frames without compiling them
(past the recompile limit).  The hook's own code is marked for Dynamo to skip
as a frame of its own, so it runs for real when a layer runs eagerly (a
compiled copy of it would constant-fold ``is_compiling()`` to True and check
nothing), while Dynamo still inlines it, as a no-op, when it traces the layer.

What it cannot see: a layer run inside a ``torch.compiler.disable``d function
called from a compiled call (Dynamo clears the callback there); that layer
keeps PEFT's eager behaviour.  What it refuses too much: a graph break inside
a LoRA layer's own forward puts its LoRA computation in a rewritten graph but
runs the hook eagerly; a mixed mapping is then refused although the graphs
serve it.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Set

import torch

from ..errors import UnsupportedMappingError

NO_LORA = -1


def _callback_getter():
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # a torch without the getter
        return None
    return get_eval_frame_callback


_GET_CALLBACK = _callback_getter()


def inside_compiled_call() -> bool:
    """Whether Python is running inside a call of a ``torch.compile``d function or module.

    The one place that decides whether an eager LoRA layer is refused (see the
    module docstring).  Without the getter (another torch) every eager run
    counts as inside: refusing too much is never a wrong batch.
    """
    if _GET_CALLBACK is None:
        return True
    return _GET_CALLBACK() is not None


def install(meta, sites, saved, old_handles: Iterable) -> List:
    """A forward hook on every LoRA layer and saved module; returns the handles (the old ones removed).

    A forward hook, not a pre-hook: it must see the ``adapter_names`` kwarg
    PEFT's own pre-hook adds for its mixed-batch path.  One hook function per
    kind, finding the module's name by the module, not a ``functools.partial``
    per module: Dynamo guards a partial's bound arguments at every call of the
    compiled model (about 6 guards per layer, 0.08 ms of 0.8 ms of guard
    checks on a PEFT model of 28 LoRA layers), and a plain function only by its code.
    """
    for handle in old_handles:
        handle.remove()
    layers = {s.module: s.name for s in sites if s.module is not None}
    wrappers = {m.wrapper: m.name for m in saved}
    check_layer, check_saved = _hook(_refuse_lora_layer, meta, layers), _hook(_refuse_saved_module, meta, wrappers)
    handles = [module.register_forward_hook(check_layer, with_kwargs=True) for module in layers]
    return handles + [wrapper.register_forward_hook(check_saved, with_kwargs=True) for wrapper in wrappers]


def _hook(refuse, meta, names):
    """The forward hook of the modules in ``names`` (module -> name): ``refuse(meta, name, module)`` when one
    runs eagerly inside a compiled call."""
    def check(module, args, kwargs, output):
        if torch.compiler.is_compiling() or kwargs.get("adapter_names") is not None:
            return None  # traced, or PEFT's own mixed-batch path, which is exact
        if inside_compiled_call():  # else plain eager PEFT, with its own semantics
            refuse(meta, names[module], module)
        return None
    return check


@torch._dynamo.disable  # a check on the host: nothing in it is for Dynamo to compile
def _refuse_lora_layer(meta, site_name: str, module) -> None:
    site = meta.sites[site_name]
    held = site.format.computed_adapters(module, site)  # what its format's eager forward adds
    active = [] if getattr(module, "disable_adapters", False) else list(getattr(module, "active_adapters", held))
    _refuse_unless_uniform(meta, f"LoRA layer {site_name}", active, held)


@torch._dynamo.disable
def _refuse_saved_module(meta, name: str, module) -> None:
    active = [] if getattr(module, "disable_adapters", False) else list(getattr(module, "active_adapters", []))
    held = [a for a in active if a in module.modules_to_save]
    # PEFT runs the original module unless every active adapter has a copy.
    _refuse_unless_uniform(meta, f"saved module {name} (modules_to_save)", active,
                           held[:1] if held and len(held) == len(active) else [])


def _refuse_unless_uniform(meta, what: str, active: List[str], computes: List[str]) -> None:
    """Accept only a mapping with every token on what the layer computes (its held active adapter, or base)."""
    values: Optional[Set[int]] = meta.mapped_slots()
    if values is None:
        return
    slots = meta.slots
    computed: Set[Optional[int]] = {slots.index(a) if a in slots else None for a in computes} or {NO_LORA}
    if len(computed) == 1 and values == computed:
        return
    raise UnsupportedMappingError(
        f"{what} is running eagerly inside a compiled call (a graph break, or Dynamo past its recompile "
        f"limit), where it computes {computes or 'the base model'} (active adapters {active}) for every token; "
        f"the token mapping uses slots {sorted(values)}. Set a uniform mapping on that, or fix the graph break "
        "(TORCH_LOGS=graph_breaks,recompiles)")


# Dynamo must not compile the hooks as frames of their own (see the module docstring); it still inlines them.
# Every hook _hook makes shares its code object.
for _code in (_hook(None, None, {}).__code__, inside_compiled_call.__code__):
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without it: the hooks may then be compiled as no-ops after a graph break
        break
    skip_code(_code)

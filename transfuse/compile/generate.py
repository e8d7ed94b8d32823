"""``generate`` without a host wait per token, and with its decode steps replayed unchecked.

transformers' decoding loop reads ``unfinished_sequences.max() == 0`` on the host after every
token, so the host cannot queue step t+1 before step t has finished on the GPU, and every
token costs the GPU time plus the host's. transformers has the way out: ``DeferredStopCheck``
copies the flag asynchronously and reads it one step late, and undoes the one extra step at
the end (the cache is cropped back, the extra token dropped), so the results are the same.
transformers turns it on only on ``mps``. transfuse turns it on for CUDA as well, for the
caches a compiled model has served (``mark``): transformers asks whether to defer right after
the prompt's forward, with the cache that forward returned.

A decoding loop of transformers' own (``_sample``: greedy and sampling; ``_beam_search``) run
on a compiled model with nothing of the caller's inside it (no streamer but transformers' own
text streamers, which decode the tokens with a transformers tokenizer and print or queue the
text; every logits processor and stopping criterion a transformers class that holds no
function or module of the caller's: ``closed``) is a *closed loop*: between two of its decode
steps only transformers' code runs, which changes no module, weight, global or grad mode.
What Dynamo's guards check before a step therefore holds for every step of the loop once it
has held for one, and the compiled model may replay a captured step without checking them
again (``replay.CallGraphs``): the first replay of each captured step in a loop checks
everything, the later ones nothing. ``install_loops`` wraps the two loops to tell the compiled model
when it is inside one (``DecodeCalls.closed_loop``). A model that is not compiled but whose
closed loops were given a path (``serve``: ``transfuse.decode_steps``) runs its steps through it.
The wrapped loops run every other model's loop as transformers wrote it.

Inside a closed greedy or sampling loop whose only stopping criteria are the length and end
tokens, and which returns just the tokens (``lean_loop``), transfuse runs the loop itself
(``_lean_sample``): the same prefill, processors, token choice, padding of finished rows,
(deferred) stop check and streaming as transformers' ``_sample``, without what a step of it
costs the host beyond those: the inputs prepared again from every keyword, the mask and the
tokens concatenated into new tensors, the length criterion evaluated on the device. At a MoE
model's decode step that host work is most of the token.

Versions of transformers without ``DeferredStopCheck`` decode as they always do; without a
loop of these names, every step is checked.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["closed", "install", "install_loops", "lean_loop", "mark", "serve", "served_by", "supported"]

# transformers' decoding loops that run only transformers' code between two decode steps when
# given nothing of the caller's (assisted decoding runs another model between them).
_LOOPS = ("_sample", "_beam_search")


def _check_class() -> Any:
    try:
        from transformers.generation import utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return getattr(utils, "DeferredStopCheck", None)


def supported() -> bool:
    return _check_class() is not None


def mark(cache: Any) -> None:
    """``generate`` with this cache may defer its stop check on CUDA."""
    try:
        cache._transfuse_defer_stop = True
    except AttributeError:  # a cache class with __slots__: no deferral
        pass


def install() -> None:
    """Wrap ``DeferredStopCheck.is_supported`` (once) to say yes on CUDA for marked caches."""
    check = _check_class()
    if check is None or getattr(check.is_supported, "_transfuse", False):
        return
    original = check.is_supported

    @functools.wraps(original)
    def is_supported(device: Any, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
        served = getattr(cache, "_transfuse_defer_stop", False)
        if served and getattr(device, "type", None) == "cuda" and not is_assistant:
            # transformers' own conditions, with cuda where they say mps.
            return cache.is_croppable or not cache_is_returned
        return original(device, cache, cache_is_returned, is_assistant)

    is_supported._transfuse = True  # type: ignore[attr-defined]
    check.is_supported = staticmethod(is_supported)


def closed(arguments: dict[str, Any]) -> bool:
    """Whether a decoding loop called with these arguments (by name) runs nothing of the
    caller's between its steps: no streamer but one of transformers' own (``TextStreamer``,
    ``TextIteratorStreamer``, not a subclass of the caller's) with a tokenizer of transformers'
    own, and only transformers' own processors and criteria, none holding a function or a
    module (a prefix function, classifier-free guidance's model)."""
    streamer = arguments.get("streamer")
    if streamer is not None and not _own_streamer(streamer):
        return False
    for name in ("logits_processor", "stopping_criteria"):
        for item in arguments.get(name) or ():
            if not _own(item):
                return False
    return True


def _own_streamer(streamer: Any) -> bool:
    tokenizer = getattr(streamer, "tokenizer", None)
    return _own(streamer) and (tokenizer is None or _of_transformers(tokenizer))


def _of_transformers(item: Any) -> bool:
    # (a model's remote code is in ``transformers_modules``, which this does not match)
    return type(item).__module__.startswith("transformers.")


def _own(item: Any) -> bool:
    if not _of_transformers(item):
        return False
    state = getattr(item, "__dict__", {})
    return not any(isinstance(value, _CODE) for value in state.values())


_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial, nn.Module)


# On a model whose closed loops take a path: what starts it (``serve``). An attribute, so that a copy of
# the model keeps its path as it keeps its rewrite.
_SERVED_ATTR = "_transfuse_decode_path"


def serve(model: nn.Module, start: Callable[[nn.Module, dict[str, Any]], Any]) -> None:
    """The closed decoding loops of ``model`` ask ``start(model, arguments)`` (the loop's arguments, by
    name) for the path their steps take: an object with ``installed()``, ``options`` and ``loops``
    (``eager_steps.EagerSteps``), or None for transformers' own loop. Wraps the loops and the stop
    check, once in the process."""
    install_loops()
    install()
    model.__dict__[_SERVED_ATTR] = start


def served_by(model: nn.Module) -> Callable[[nn.Module, dict[str, Any]], Any] | None:
    """What starts the path of ``model``'s closed loops (``serve``), or None."""
    return model.__dict__.get(_SERVED_ATTR)


def install_loops() -> None:
    """Wrap transformers' decoding loops (once) to run closed loops of compiled models, and of models
    given a path (``serve``), as such."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    for name in _LOOPS:
        original = GenerationMixin.__dict__.get(name)
        if original is None or getattr(original, "_transfuse", False):
            continue
        setattr(GenerationMixin, name, _closing(original, lean=name == "_sample"))


def _closing(original: Any, lean: bool) -> Any:
    """``original`` (a decoding loop) run as a closed loop where it is one; ``lean``: the loop
    is ``_sample``, which ``_lean_sample`` may stand in for."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = getattr(self, "_transfuse_compiled", None)
        if compiled is not None and self.__dict__.get("_compiled_call_impl") is not compiled:
            compiled = None
        start = served_by(self) if compiled is None else None
        if compiled is None and start is None:  # neither compiled nor given a path
            return original(self, *args, **kwargs)
        try:
            arguments = signature.bind_partial(self, *args, **kwargs).arguments
        except TypeError:  # another version's loop: its steps are checked
            return original(self, *args, **kwargs)
        if not closed(arguments):
            return original(self, *args, **kwargs)
        if compiled is not None:
            running = compiled.closed_loop()
        else:  # a model given a path, not compiled (``eager_steps``: graphs of its eager forward)
            compiled = start(self, arguments)
            if compiled is None:
                return original(self, *args, **kwargs)
            running = compiled.installed()
        with running:
            if lean and compiled.options["lean_loop"] and lean_loop(self, arguments):
                compiled.loops["transfuse"] += 1
                return _lean_sample(self, compiled, arguments)
            compiled.loops["transformers"] += 1
            return original(self, *args, **kwargs)

    loop._transfuse = True  # type: ignore[attr-defined]
    return loop


# The keyword arguments ``_sample`` passes on to the model that ``_lean_sample`` passes on too.
_LEAN_KWARGS = frozenset({"attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep", "position_ids"})


def lean_loop(model: Any, arguments: dict[str, Any]) -> bool:
    """Whether ``_lean_sample`` may run this call of ``_sample`` (arguments by name): a
    decoder-only model whose decode steps take the inputs transformers' own generation code
    gives them, tokens only returned, no peers to wait for, stopping criteria of
    transformers' length and end-token classes with a length, inputs of ids, a padding mask and
    the cache, and a cache that is not handed back to the caller where the stop check defers."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    config = arguments.get("generation_config")
    criteria = arguments.get("stopping_criteria")
    input_ids = arguments.get("input_ids")
    model_kwargs = arguments.get("model_kwargs") or {}
    if config is None or criteria is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return False
    if not _prepares_inputs_as_transformers_does(model):
        return False
    if config.return_dict_in_generate or getattr(config, "is_assistant", False) or arguments.get("synced_gpus"):
        return False
    if getattr(model.config, "is_encoder_decoder", False) or not model_kwargs.get("use_cache", True):
        return False
    if any(type(c) not in (MaxLengthCriteria, EosTokenCriteria) for c in criteria):
        return False
    if getattr(criteria, "max_length", None) is None or set(model_kwargs) - _LEAN_KWARGS:
        return False
    positions = model_kwargs.get("position_ids")
    if positions is not None and not isinstance(positions, torch.Tensor):
        return False
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    ends = any(isinstance(c, EosTokenCriteria) for c in criteria)
    # A cache the caller gave is theirs afterwards: a step past the end would have to be undone in it.
    return not (ends and getattr(cache, "_is_user_defined", False))


def _prepares_inputs_as_transformers_does(model: Any) -> bool:
    """Whether a decode step's inputs are what the lean loop hands the model: the model's class
    keeps transformers' own ``prepare_inputs_for_generation`` and
    ``_update_model_kwargs_for_generation`` (a class of its own may pass a state, the whole text
    to a model without a cache, or images) and decodes with transformers' dynamic cache."""
    from transformers import GenerationMixin

    cls = type(model)
    if cls.prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
        return False
    if cls._update_model_kwargs_for_generation is not GenerationMixin._update_model_kwargs_for_generation:
        return False
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return supports is None or bool(supports())


class _FirstAtOnce:
    """A streamer's stand-in for a deferred stop check, which hands each token on a step late: the
    first generated token (the prompt's) is given to the streamer as soon as it is chosen
    (``put_at_once``, one wait for the prompt's forward), and the check's own later hand-over of
    it is dropped. The time to the first streamed token is then the prompt's, not the prompt's
    and the first decode step's (on a compiled model that step's compilation too)."""

    def __init__(self, streamer: Any):
        self.streamer = streamer
        self.pending = 0

    def put_at_once(self, tokens: torch.Tensor) -> None:
        self.streamer.put(tokens.cpu())
        self.pending += 1

    def put(self, value: torch.Tensor) -> None:
        if self.pending:  # the check handing on a token already given
            self.pending -= 1
            return
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


def _lean_sample(model: Any, compiled: Any, arguments: dict[str, Any]) -> torch.Tensor:
    """transformers' ``_sample`` for the calls ``lean_loop`` admits, with the host's work a step
    cut to the step itself. The tokens go into one buffer of the final length, the padding mask
    is a view of one (ones past the prompt), the length criterion is the loop's bound, and the
    end tokens are checked on the device, read a step late on CUDA (``DeferredStopCheck``, which
    also hands the streamer each token, a step late there, as in ``_sample``, the first at once)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria
    from transformers.generation.utils import StopCheck

    input_ids = arguments["input_ids"]
    streamer = arguments.get("streamer")
    processors = arguments.get("logits_processor")
    criteria = arguments["stopping_criteria"]
    config = arguments["generation_config"]
    model_kwargs = dict(arguments.get("model_kwargs") or {})
    max_length = criteria.max_length
    ends = [c for c in criteria if isinstance(c, EosTokenCriteria)]
    batch, prompt = input_ids.shape
    device = input_ids.device

    outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=True)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
    cache_name = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(cache_name)

    tokens = input_ids.new_empty(batch, max(max_length, prompt))
    tokens[:, :prompt] = input_ids
    mask = model_kwargs.pop("attention_mask", None)
    if mask is not None:
        grown = mask.new_ones(batch, max(max_length, mask.shape[1]))
        grown[:, : mask.shape[1]] = mask
        mask = grown
    # Each step's positions: the one after the last (``_update_model_kwargs_for_generation``
    # appends it, ``prepare_inputs_for_generation`` passes that column on).
    positions = model_kwargs.pop("position_ids", None)
    if positions is not None:
        positions = positions[..., -1:].clone(memory_format=torch.contiguous_format)
    step_kwargs = {name: value for name, value in model_kwargs.items() if name in _LEAN_KWARGS}
    step_kwargs["return_dict"] = True
    forward = model.__call__
    choose_in_float = bool(processors) or config.do_sample

    pad = config._pad_token_tensor
    if ends and pad is not None:
        pad = pad.to(device)
    # The stop check, which also hands each token to the streamer (a step late where it defers:
    # the prompt's token then goes to the streamer at once, ``_FirstAtOnce``).
    stop_check = unfinished = early = None
    if ends or streamer is not None:
        unfinished = torch.ones(batch, dtype=torch.long, device=device)
        deferred = _check_class()
        if deferred is not None and deferred.is_supported(device, cache, False, is_assistant=False):
            early = _FirstAtOnce(streamer) if streamer is not None else None
            stop_check = deferred(input_ids, max_length, cache, False, early or streamer)
        else:
            stop_check = StopCheck(streamer)

    length = prompt
    optimise = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    with optimise():
        while True:
            logits = outputs.logits[:, -1]
            if choose_in_float:
                scores = logits.to(copy=True, dtype=torch.float32, device=device)
                if processors:
                    scores = processors(tokens[:, :length], scores)
                if config.do_sample:
                    chosen = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    chosen = torch.argmax(scores, dim=-1)
            else:  # the argmax of the float32 copy is the argmax of the logits
                chosen = torch.argmax(logits, dim=-1).to(device)
            if ends:
                chosen = chosen * unfinished + pad * (1 - unfinished)
            tokens[:, length] = chosen
            length += 1
            if ends:
                done = ends[0](tokens[:, :length], None)
                for criterion in ends[1:]:
                    done = done | criterion(tokens[:, :length], None)
                unfinished = unfinished & ~done
            if early is not None and length == prompt + 1:
                early.put_at_once(chosen)
            if stop_check is not None:
                if stop_check(unfinished, chosen, length) or length >= max_length:
                    break
            elif length >= max_length:
                break
            if mask is not None:
                step_kwargs["attention_mask"] = mask[:, :length]
            if positions is not None:
                step_kwargs["position_ids"] = positions
                positions = positions + 1
            outputs = forward(input_ids=chosen.unsqueeze(1), **step_kwargs)
    undo = stop_check.finish() if stop_check is not None else 0
    if streamer is not None:
        streamer.end()
    return tokens[:, : length - undo].contiguous()

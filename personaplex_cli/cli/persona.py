"""The model with a persona, ready to talk: what `reply` and `talk` open the same way."""

from __future__ import annotations

from .output import Output


def open_model(out: Output, model_spec: str, device: str, dtype, quantize, streams: int = 1,
               streams_option: str | None = None, *, check_room: bool = True):
    """The Model, once its files are found to fit each other (exit 6) and a run of `streams`
    streams to fit the device's memory (exit 5, naming the option that fits), before any
    weight is loaded (`check_room=False`: the caller runs `room_for` itself, later)."""
    from ..model.model import Model

    model = Model.open(model_spec, device, dtype.value if dtype else None,
                       quantize.value if quantize else "none")
    out.info(f"model: {model.path}")
    weights = "" if model.quantize == "none" else f", {model.quantize} weights"
    out.info(f"device: {model.device}, {str(model.dtype).removeprefix('torch.')}{weights}")
    if check_room:
        room_for(out, model, streams, streams_option)
    return model


def room_for(out: Output, model, streams: int, streams_option: str | None) -> None:
    """The files fit each other and `streams` streams fit the device, or exit 6 / 5."""
    need = model.preflight(streams, streams_option if streams > 1 else None)
    out.info(f"memory: about {need.total / 2**30:.1f} GiB ({need})")


def open_conversation(out: Output, model_spec: str, device: str, dtype, voice_spec: str,
                      role: str, how, batch: int = 1, quantize=None):
    """Opens the model (`open_model`), finds the voice, prepares the persona -> an unprimed
    Conversation of `batch` streams (its `.model` is the Model)."""
    from ..prompts.persona import Persona, prepare_persona
    from ..prompts.voices import find_voice
    from ..runtime.scheduler import Conversation

    model = open_model(out, model_spec, device, dtype, quantize, batch, "--batch-size")
    voice = find_voice(voice_spec, model.files.voices_dir(), model.files.voices_hint())
    prompt = prepare_persona(model, Persona(voice, role))
    out.info(f"voice: {voice.path if voice else 'none'}; role prompt: "
             f"{len(prompt.text_tokens)} tokens; priming: {prompt.frames} frames")
    if prompt.frames > model.lm.context:
        out.warn(f"the voice and role prompt take {prompt.frames} frames, more than the "
                 f"model's context of {model.lm.context}: the start of the persona is lost")
    return Conversation(model, prompt, how, batch=batch)

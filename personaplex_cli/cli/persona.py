"""The model with a persona, ready to talk: what `reply` and `talk` open the same way."""

from __future__ import annotations

from .output import Output


def open_conversation(out: Output, model_spec: str, device: str, dtype, voice_spec: str,
                      role: str, how, batch: int = 1, quantize=None):
    """Checks that the model's files fit each other and the run fits the device's memory,
    loads the model, finds the voice, prepares the persona -> an unprimed Conversation of
    `batch` streams (its `.model` is the Model)."""
    from ..conversation import Conversation, Persona, prepare_persona
    from ..model.model import Model
    from ..prompts.voices import find_voice

    model = Model.open(model_spec, device, dtype.value if dtype else None,
                       quantize.value if quantize else "none")
    out.info(f"model: {model.path}")
    weights = "" if model.quantize == "none" else f", {model.quantize} weights"
    out.info(f"device: {model.device}, {str(model.dtype).removeprefix('torch.')}{weights}")
    need = model.preflight(batch, "--batch-size" if batch > 1 else None)
    out.info(f"memory: about {need.total / 2**30:.1f} GiB ({need})")
    voice = find_voice(voice_spec, model.files.voices_dir())
    prompt = prepare_persona(model, Persona(voice, role))
    out.info(f"voice: {voice.path if voice else 'none'}; role prompt: "
             f"{len(prompt.text_tokens)} tokens; priming: {prompt.frames} frames")
    if prompt.frames > model.lm.context:
        out.warn(f"the voice and role prompt take {prompt.frames} frames, more than the "
                 f"model's context of {model.lm.context}: the start of the persona is lost")
    return Conversation(model, prompt, how, batch=batch)

"""The model with a persona, ready to talk: what `reply` and `talk` open the same way."""

from __future__ import annotations

from ..core.config import DEFAULT_COMPILE
from .output import Output


def open_model(out: Output, model_spec: str, device: str, dtype, quantize, graphs=None,
               compile_mode=None):
    """The Model, its files found; nothing is read or loaded yet (runtime.open checks that
    they fit each other and the device's memory, says what --compile does, then loads them).
    `graphs`: --graphs (None: auto), refused here where the device has no CUDA graphs."""
    from ..model.model import Model
    from .options import graphs_choice

    model = Model.open(model_spec, device, dtype.value if dtype else None,
                       quantize.value if quantize else "none",
                       graphs=None if graphs is None else graphs_choice(graphs),
                       compile_mode=compile_mode.value if compile_mode else DEFAULT_COMPILE)
    out.info(f"model: {model.path}")
    weights = "" if model.quantize == "none" else f", {model.quantize} weights"
    out.info(f"device: {model.device}, {str(model.dtype).removeprefix('torch.')}{weights}")
    return model


def open_persona(out: Output, model_spec: str, device: str, dtype, voice_spec: str,
                 role: str, quantize=None, graphs=None, compile_mode=None):
    """Opens the model (`open_model`), finds the voice, prepares the persona -> (the Model,
    the prompts.persona.PersonaPrompt)."""
    from ..prompts.persona import Persona, prepare_persona
    from ..prompts.voices import find_voice

    model = open_model(out, model_spec, device, dtype, quantize, graphs, compile_mode)
    voice = find_voice(voice_spec, model.files.voices_dir(), model.files.voices_hint())
    prompt = prepare_persona(model, Persona(voice, role))
    out.info(f"voice: {voice.path if voice else 'none'}; role prompt: "
             f"{len(prompt.text_tokens)} tokens; priming: {prompt.frames} frames")
    context = model.arch.lm["context"]
    if prompt.frames > context:
        out.warn(f"the voice and role prompt take {prompt.frames} frames, more than the "
                 f"model's context of {context}: the start of the persona is lost")
    return model, prompt

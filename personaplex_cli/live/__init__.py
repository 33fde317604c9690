"""Live audio for `personaplex talk`: the hardware-facing building blocks.

- `jitter`:  `OutputJitterBuffer` (model -> speaker, with a record of what was played) and
             `InputQueue` (caller -> model, bounded: the callers' one drop-oldest queue,
             serve's too), with their bounds; pure numpy.
- `echo`:    `EchoCanceller`, WebRTC AEC3 through pywebrtc-audio (imported lazily), behind
             `EchoPathDetector` (the microphone as it is until an echo path is found).
- `devices`: sounddevice/PortAudio: device list and lookup, rate choice, `DuplexStream`
             (one full-duplex stream, or one side of it, and its watchdog).
- `rates`:   `RateAdapter` for devices that refuse 24 kHz (soxr, imported lazily).
- `loop`:    the inference thread (`LiveLoop`): caller sources (the microphone, echo-cancelled,
             or a recording at real-time pace), talk's row run by the scheduler it is given
             (the runtime's, paced by the source), the speaker or a file as the sink; its
             exception waits for the main thread. live/ stands below the runtime.
- `record`:  `IncrementalWav`, the session's stereo recording, valid up to the last second.
- `view`:    the live view on a terminal (`render_view`, `LiveView`) and `Terminal`, the
             one thread that writes a session's output.

How `talk` wires them, per 80 ms frame on the inference thread::

    frame, pos = stream.read()                       # mic frame and its sample position
    ec.delay_ms = stream.echo_delay_ms               # PortAudio's device delay
    clean = ec.process(frame, stream.played(pos, len(frame)))
    stream.write(model_step(clean))                  # one output frame per input frame

Nothing here imports torch or typer, and only `view` uses rich (when it draws); numpy is
the only import at module load.
"""

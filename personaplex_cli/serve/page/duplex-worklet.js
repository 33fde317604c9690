// The page's audio thread: plays the assistant through a jitter buffer and records both
// sides as heard (input: the microphone; output: what is played), sample for sample.
"use strict";

class Duplex extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.prefill = Math.round((opts.prefillSeconds || 0.16) * sampleRate);
    this.maxDepth = Math.round((opts.maxBufferSeconds || 1.0) * sampleRate);
    this.queue = [];
    this.offset = 0; // into queue[0]
    this.depth = 0; // samples waiting
    this.playing = false;
    this.underruns = 0;
    this.overflows = 0;
    this.played = 0;
    this.received = 0;
    this.recording = [];
    this.lastReport = 0;
    this.port.onmessage = (event) => {
      if (event.data.audio) this.push(event.data.audio);
    };
  }

  push(chunk) {
    this.queue.push(chunk);
    this.depth += chunk.length;
    this.received += chunk.length;
    while (this.depth > this.maxDepth && this.queue.length > 1) {
      const dropped = this.queue.shift();
      this.depth -= dropped.length - this.offset;
      this.offset = 0;
      this.overflows += 1;
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const mic = inputs[0] && inputs[0][0];
    if (!this.playing && this.depth >= this.prefill) this.playing = true;
    let i = 0;
    if (this.playing) {
      while (i < out.length && this.queue.length) {
        const head = this.queue[0];
        const n = Math.min(out.length - i, head.length - this.offset);
        out.set(head.subarray(this.offset, this.offset + n), i);
        i += n;
        this.offset += n;
        this.depth -= n;
        if (this.offset === head.length) {
          this.queue.shift();
          this.offset = 0;
        }
      }
      if (i < out.length) { // ran dry: wait for the buffer to fill again
        this.underruns += 1;
        this.playing = false;
      }
    }
    out.fill(0, i);
    this.played += i;
    const both = new Float32Array(2 * out.length);
    for (let k = 0; k < out.length; k++) {
      both[2 * k] = mic ? mic[k] : 0;
      both[2 * k + 1] = out[k];
    }
    this.recording.push(both);
    if (currentTime - this.lastReport >= 0.25) {
      this.lastReport = currentTime;
      const chunks = this.recording;
      this.recording = [];
      this.port.postMessage({
        depthSeconds: this.depth / sampleRate, underruns: this.underruns,
        overflows: this.overflows, playedSeconds: this.played / sampleRate,
        receivedSeconds: this.received / sampleRate, chunks,
      }, chunks.map((c) => c.buffer));
    }
    return true;
  }
}

registerProcessor("duplex", Duplex);

// The page: the microphone to `personaplex serve` and the assistant back, over NVIDIA's
// protocol (Ogg Opus pages in 0x01 messages, text pieces in 0x02), with opus-recorder
// doing the Opus both ways. `window.personaplex` holds the figures shown (tests read it).
"use strict";

const KIND = { handshake: 0x00, audio: 0x01, text: 0x02, metadata: 0x04, error: 0x05 };
const MODEL_RATE = 24000;
const MAX_RECORDING_SECONDS = 30 * 60;

const $ = (id) => document.getElementById(id);
const figures = window.personaplex = {
  state: "idle", handshake: false, audioMessages: 0, textPieces: 0, sentPages: 0,
  sentSeconds: 0, playedSeconds: 0, receivedSeconds: 0, bufferSeconds: 0, underruns: 0,
  overflows: 0, server: null, closeCode: null, closeMessage: null,
};
let call = null;

function say(text) { $("status").textContent = text; }

async function loadVoices() {
  const response = await fetch("api/voices");
  if (!response.ok) {
    say(`Cannot list the voices: ${response.status} ${await response.text()}`);
    return;
  }
  const info = await response.json();
  const select = $("voice");
  for (const voice of info.voices) {
    const option = new Option(`${voice.name}${voice.origin === "user" ? " (yours)" : ""}`,
                              voice.name);
    select.add(option);
  }
  if (info.voices.some((v) => v.name === info.default_voice)) select.value = info.default_voice;
  $("role").value = info.default_role;
  say(info.voices.length ? "Ready." : "Ready (the server has no named voices: its default).");
}

function chatURL() {
  const url = new URL("api/chat", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  if ($("voice").value) url.searchParams.set("voice_prompt", `${$("voice").value}.pt`);
  url.searchParams.set("text_prompt", $("role").value);
  url.searchParams.set("stats", "1");
  return url.toString();
}

async function start() {
  $("start").disabled = true;
  $("download").hidden = true;
  $("monologue").textContent = "";
  Object.assign(figures, { state: "starting", handshake: false, audioMessages: 0,
    textPieces: 0, sentPages: 0, server: null, closeCode: null, closeMessage: null });
  try {
    call = await openCall();
  } catch (error) {
    say(`Cannot start: ${error.message || error}`);
    $("start").disabled = false;
    figures.state = "failed";
    return;
  }
  $("stop").disabled = false;
  say("Priming the persona…");
}

async function openCall() {
  const ctx = new AudioContext();
  await ctx.audioWorklet.addModule("duplex-worklet.js");
  const mic = await navigator.mediaDevices.getUserMedia({ audio: {
    channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false } });
  const source = ctx.createMediaStreamSource(mic);
  const duplex = new AudioWorkletNode(ctx, "duplex", { numberOfInputs: 1, numberOfOutputs: 1,
    outputChannelCount: [1], processorOptions: { prefillSeconds: 0.16 } });
  source.connect(duplex);
  duplex.connect(ctx.destination);
  const c = { ctx, mic, source, duplex, recording: [], recorded: 0, ws: null, recorder: null,
              decoder: null };
  duplex.port.onmessage = (event) => onDuplex(c, event.data);
  c.decoder = new Worker("vendor/decoderWorker.min.js");
  c.decoder.postMessage({ command: "init", decoderSampleRate: MODEL_RATE,
    outputBufferSampleRate: ctx.sampleRate, bufferLength: Math.round(960 * ctx.sampleRate / MODEL_RATE),
    resampleQuality: 3 });
  c.decoder.onmessage = (event) => {
    if (event.data && event.data[0]) duplex.port.postMessage({ audio: event.data[0] });
  };
  const ws = c.ws = new WebSocket(chatURL());
  ws.binaryType = "arraybuffer";
  ws.onmessage = (event) => onMessage(c, new Uint8Array(event.data));
  ws.onclose = (event) => onClose(c, event);
  return c;
}

function onMessage(c, data) {
  const kind = data[0];
  const payload = data.subarray(1);
  if (kind === KIND.handshake) {
    figures.handshake = true;
    figures.state = "talking";
    say("Connected: speak.");
    startRecorder(c);
  } else if (kind === KIND.audio) {
    figures.audioMessages += 1;
    const pages = payload.slice();
    c.decoder.postMessage({ command: "decode", pages }, [pages.buffer]);
  } else if (kind === KIND.text) {
    figures.textPieces += 1;
    $("monologue").textContent += new TextDecoder().decode(payload);
  } else if (kind === KIND.metadata) {
    figures.server = JSON.parse(new TextDecoder().decode(payload));
    showLive();
  } else if (kind === KIND.error) {
    figures.closeMessage = new TextDecoder().decode(payload);
    say(figures.closeMessage);
  }
}

function startRecorder(c) {
  const recorder = c.recorder = new Recorder({
    sourceNode: c.source, encoderPath: "vendor/encoderWorker.min.js",
    encoderSampleRate: MODEL_RATE, encoderFrameSize: 20, maxFramesPerPage: 2,
    encoderApplication: 2049, encoderComplexity: 0, numberOfChannels: 1, streamPages: true,
    bufferLength: Math.round(960 * c.ctx.sampleRate / MODEL_RATE), resampleQuality: 3,
    monitorGain: 0, recordingGain: 1,
  });
  recorder.ondataavailable = (page) => {
    if (c.ws.readyState !== WebSocket.OPEN) return;
    const message = new Uint8Array(page.length + 1);
    message[0] = KIND.audio;
    message.set(page, 1);
    c.ws.send(message);
    figures.sentPages += 1;
    figures.sentSeconds = recorder.encodedSamplePosition / 48000;
  };
  recorder.start();
}

function onDuplex(c, report) {
  figures.bufferSeconds = report.depthSeconds;
  figures.underruns = report.underruns;
  figures.overflows = report.overflows;
  figures.playedSeconds = report.playedSeconds;
  figures.receivedSeconds = report.receivedSeconds;
  if (figures.handshake && c.recorded < MAX_RECORDING_SECONDS * c.ctx.sampleRate) {
    for (const chunk of report.chunks) {
      c.recording.push(chunk);
      c.recorded += chunk.length / 2;
    }
  }
  showLive();
}

function showLive() {
  const s = figures.server || {};
  // What was sent and not yet heard back: the server's queues, the network, our buffer.
  const latency = figures.handshake ? Math.max(0, figures.sentSeconds - figures.playedSeconds) : null;
  const dropped = (s.dropped_in || 0) + (s.dropped_out || 0);
  const parts = [
    `latency ${latency === null ? "–" : Math.round(1000 * latency) + " ms"}`,
    `buffer ${Math.round(1000 * figures.bufferSeconds)} ms`,
    `dropped ${dropped} (server) · late ${s.late || 0} · underruns ${figures.underruns}`,
    `heard ${s.input_dbfs === undefined ? "–" : s.input_dbfs + " dBFS"}`,
  ];
  $("live").textContent = parts.join(" · ");
}

function stop() {
  if (call && call.ws) call.ws.close(1000);
}

function onClose(c, event) {
  figures.closeCode = event.code;
  figures.state = "closed";
  if (c.recorder) c.recorder.stop();
  c.mic.getTracks().forEach((track) => track.stop());
  c.decoder.terminate();
  const why = figures.closeMessage ? `: ${figures.closeMessage}` : "";
  say(`Call ended (code ${event.code})${why}`);
  if (c.recorded > 0) offerRecording(c);
  c.ctx.close();
  $("stop").disabled = true;
  $("start").disabled = false;
  call = null;
}

function offerRecording(c) {
  const frames = c.recorded;
  const rate = c.ctx.sampleRate;
  const view = new DataView(new ArrayBuffer(44 + frames * 4));
  const text = (at, s) => [...s].forEach((ch, i) => view.setUint8(at + i, ch.charCodeAt(0)));
  text(0, "RIFF"); view.setUint32(4, 36 + frames * 4, true); text(8, "WAVE");
  text(12, "fmt "); view.setUint32(16, 16, true); view.setUint16(20, 1, true);
  view.setUint16(22, 2, true); view.setUint32(24, rate, true); view.setUint32(28, rate * 4, true);
  view.setUint16(32, 4, true); view.setUint16(34, 16, true);
  text(36, "data"); view.setUint32(40, frames * 4, true);
  let at = 44;
  for (const chunk of c.recording) {
    for (let k = 0; k < chunk.length && at < 44 + frames * 4; k++, at += 2) {
      view.setInt16(at, Math.max(-32768, Math.min(32767, Math.round(chunk[k] * 32767))), true);
    }
  }
  const link = $("download");
  link.href = URL.createObjectURL(new Blob([view], { type: "audio/wav" }));
  link.hidden = false;
}

$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
loadVoices().catch((error) => say(`Cannot reach the server: ${error}`));

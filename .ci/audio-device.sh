#!/usr/bin/env bash
# Sourced by .ci/run: PortAudio for `import sounddevice`, and a playback device with a real
# clock on a machine without a sound card (JACK's dummy driver). Idempotent and quick when
# everything is installed and running already. Sets PCGTTS_JACKD_PID when it starts the server.
export DEBIAN_FRONTEND=noninteractive
if ! dpkg -s libportaudio2 jackd2 >/dev/null 2>&1; then
    # jackd2 asks whether to enable real-time priority: answer no, non-interactively.
    echo "jackd2 jackd/tweak_rt_limits boolean false" | debconf-set-selections
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends libportaudio2 jackd2 >/dev/null
fi
start_jackd() {  # $1: --realtime or --no-realtime; succeeds once the server answers
    # 48 kHz like most real cards, so the 16 kHz -> device-rate resampling path is exercised.
    nohup jackd "$1" -d dummy -r 48000 -p 256 >/tmp/pcgtts-jackd.log 2>&1 &
    # The server this script started (only then): .ci/run stops it when it exits.
    export PCGTTS_JACKD_PID=$!
    for _ in $(seq 50); do
        jack_lsp >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    kill "$PCGTTS_JACKD_PID" 2>/dev/null
    wait "$PCGTTS_JACKD_PID" 2>/dev/null
    return 1
}
if ! pgrep -x jackd >/dev/null 2>&1; then
    # Real-time scheduling where the machine allows it (as on a real audio setup): a non-real-time
    # JACK thread starved for a second on a busy machine times out PortAudio's JACK host API, whose
    # stream shutdown (PortAudio 19.6) can then free a stream its process thread still runs: a crash.
    if ! { chrt -f 10 true 2>/dev/null && start_jackd --realtime; }; then
        start_jackd --no-realtime || true
    fi
fi
export PCGTTS_EXPECT_AUDIO_DEVICE=1  # tests fail (instead of skipping) if no device shows up

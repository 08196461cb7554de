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
if ! pgrep -x jackd >/dev/null 2>&1; then
    # 48 kHz like most real cards, so the 16 kHz -> device-rate resampling path is exercised.
    nohup jackd --no-realtime -d dummy -r 48000 -p 256 >/tmp/pcgtts-jackd.log 2>&1 &
    # The server this script started (only then): .ci/run stops it when it exits.
    export PCGTTS_JACKD_PID=$!
    for _ in $(seq 50); do
        jack_lsp >/dev/null 2>&1 && break
        sleep 0.1
    done
fi
export PCGTTS_EXPECT_AUDIO_DEVICE=1  # tests fail (instead of skipping) if no device shows up

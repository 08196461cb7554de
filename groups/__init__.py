"""Acoustic Similarity Groups: built from an embedding matrix (`build.py`), stored as a compact
16-bit table (`table.py`, the .pcg format), and laid out for the acceptance rule (`device.py`).
Depends on nothing else in pcgtts."""

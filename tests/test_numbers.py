"""The text front end's number reading (runtime/text/numbers.py): signs, decimals, versions and
what must stay as it is (hyphenated words, ranges)."""

from __future__ import annotations

import pytest

from pcgtts.runtime.text.numbers import spell_numbers


@pytest.mark.parametrize("text, words", [
    # a minus sign before a number is read
    ("A -0.5% drop.", "A minus zero point five percent drop."),
    ("-5", "minus five"),
    ("-3 degrees", "minus three degrees"),
    ("\u22125", "minus five"),
    ("5 \u2212 3", "five minus three"),
    ("(-5)", "(minus five)"),
    ("-1,000.5", "minus one thousand point five"),
    ("-$5", "minus five dollars"),
    # version numbers: group by group
    ("2.0.1", "two point zero point one"),
    ("v2.0.1", "version two point zero point one"),
    ("Python 3.11.4 is out.", "Python three point eleven point four is out."),
    ("1.05.2", "one point zero five point two"),
    # decimals: a sentence's full stop is not a decimal point, a fraction is not a year
    ("1.5.", "one point five."),
    ("1,000.5", "one thousand point five"),
    ("0.5%", "zero point five percent"),
    ("pi is 3.1415.", "pi is three point one four one five."),
    # dollars
    ("$1", "one dollar"),
    ("$1.5 million", "one point five million dollars"),
    ("$1.5", "one point five dollars"),
    ("$0.01", "zero dollars one cent"),
])
def test_signs_decimals_and_versions(text, words):
    assert spell_numbers(text) == words


@pytest.mark.parametrize("text, words", [
    # a hyphen between numbers or inside a word is not a minus sign
    ("5-3", "five - three"),
    ("1990-1995", "nineteen ninety - nineteen ninety five"),
    ("well-known", "well-known"),
    ("COVID-19", "COVID- nineteen"),
    ("ages 5 - 10", "ages five - ten"),
    # what was read well before still is
    ("We counted 42 birds, at 9:05!", "We counted forty two birds, at nine oh five!"),
    ("In 1998 the 3rd team paid $20.50.", "In nineteen ninety eight the third team paid twenty dollars fifty cents."),
    ("About 15% of 1,200 seats.", "About fifteen percent of one thousand two hundred seats."),
    ("2020.5", "two thousand twenty point five"),
])
def test_hyphens_and_plain_numbers_kept(text, words):
    assert spell_numbers(text) == words

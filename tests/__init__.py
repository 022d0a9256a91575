"""kvstrata's tests, in folders that mirror the source."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout

"""The decoding engine and its step trace."""

from mars_bench.decoding.engine import DecodeSettings, decode
from mars_bench.decoding.trace import DecodeResult, StepRecord

__all__ = ["DecodeResult", "DecodeSettings", "StepRecord", "decode"]

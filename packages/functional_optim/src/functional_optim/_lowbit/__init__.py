"""Low-bit optimizer states: moments stored as blockwise-scaled 8-bit, 4-bit or fp8 codes."""

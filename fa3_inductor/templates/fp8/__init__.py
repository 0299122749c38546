"""The FP8 family: e4m3 attention on the prologue's operands (templates/fp8_prologue/)."""

"""The kernel: the interleaver that steps intervention coroutines, and its trap protocol."""

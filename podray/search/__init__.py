"""Search for MuZero, written on mctx (pure JAX, no C++ tree code).

Reserved for the MuZero agent; nothing is implemented here yet (no open issue asks for it).
"""

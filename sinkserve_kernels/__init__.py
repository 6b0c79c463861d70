"""Attention kernels: a torch reference for every kernel (``reference``) and Triton versions beside it."""

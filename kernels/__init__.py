"""hearth.kernels: one folder per GPU operator (Triton kernel + launcher + plain-torch reference).
Imports torch and triton only."""

# pymla kernels: the fused MLA decode branch with fp8 weights as a MAX custom op.

"""Comparators for VFEM: complete-case, mean-imputation and single-party OLS."""

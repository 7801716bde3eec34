"""VFEM: federated EM for linear regression with missing blocks."""

"""Baselines for missing blocks: local, standard-vfl, ensemble, combinatorial, plugvfl."""

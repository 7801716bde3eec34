"""LASER-VFL (ICLR 2025): one predictor per subset of present parties."""

"""Tools around runs: benchmarks (`bench`), `report`, `compare`, the torchft baseline harness,
the failure simulator (`simulate`) and the Hugging Face `export`. Nothing in `recover.runtime` or
`recover.training` imports this package.
"""

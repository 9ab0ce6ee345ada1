"""Benchmark and figure scripts (run as files: ``python graphs/<script>.py``). A regular package, so
an unrelated installed ``graphs`` distribution cannot shadow the helpers the scripts import."""

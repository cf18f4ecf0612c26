"""The chapters' pictures are drawn by code: ``python -m docs.figures`` regenerates every SVG in docs/img."""

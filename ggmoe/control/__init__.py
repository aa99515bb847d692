"""What joins the cache with routing and predictors: the async decode's per-token controller.

Sits above ``cache`` and ``predict`` and below ``engine`` and ``simulate``, so both drive the same code.
"""

from ggmoe.control.controller import TokenController

__all__ = ["TokenController"]

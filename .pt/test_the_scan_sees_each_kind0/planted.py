import contextlib, contextvars
STATS = LaneStats()
SEEN = set()
__all__ = []
def hook(op):
    setattr(op, 'x', 1)
    return vars(op)
@contextlib.contextmanager
def opened(extension, value):
    yield
def gate(module):
    return binding_swapped(module, 'name', lambda f: f)

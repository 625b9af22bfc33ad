"""The one widget the chapters' steppers share: a play button and a slider over frames."""

from __future__ import annotations

from collections.abc import Callable

import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def frame_player(num_frames: int, draw: Callable[[int], Figure], *, interval: int = 400,
                 description: str = "frame"):
    """An ipywidgets player: ``draw(i)`` is shown for the slider's frame ``i``."""
    import ipywidgets as widgets
    from IPython.display import display

    play = widgets.Play(value=0, min=0, max=num_frames - 1, interval=interval)
    slider = widgets.IntSlider(value=0, min=0, max=num_frames - 1, description=description)
    widgets.jslink((play, "value"), (slider, "value"))
    out = widgets.Output()

    def show(change=None) -> None:
        fig = draw(slider.value)
        with out:
            out.clear_output(wait=True)
            display(fig)
        plt.close(fig)

    slider.observe(show, names="value")
    show()
    return widgets.VBox([widgets.HBox([play, slider]), out])

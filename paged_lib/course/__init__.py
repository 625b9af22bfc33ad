"""The course around the system: graders, the scoreboard, pictures, widgets, chapter demos.

Nothing in the system part of :mod:`paged_lib` nor in :mod:`paged_lib.studies` imports
this package (a test checks it): the engine, the kernels, the block tables and the
chapters' measurements run without the course.
"""

from paged_lib.course.show import show_source

__all__ = ["show_source"]

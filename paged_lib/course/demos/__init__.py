"""Small pieces a chapter runs to make its point (the tour's kernel, chapter 05's batch,
chapter 06's engine-versus-simulator comparison); not part of the system."""

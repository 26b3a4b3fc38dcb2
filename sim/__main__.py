"""Lets `python -m genq.sim` start the simulator, so tests need no installed entry point."""

from genq.sim.cli import sim_server

if __name__ == "__main__":
    sim_server()

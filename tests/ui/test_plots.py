"""The UI's reward histograms as drawn (pure: no server, no browser)."""

from __future__ import annotations

from app.domain.projection.overview import reward_distribution
from app.ui.plots import reward_histograms


def test_histogram_bins_of_rewards_spanning_float64_read_as_numbers() -> None:
    """The bins' ranges as the tooltips show them: finite edges from low to high (a range
    past float64 made the step inf and the edges `[nan, nan)` and `[inf, inf)`)."""
    dist = reward_distribution([(["1"], 1e308), (["1"], -1e308)], bins=4)
    [(_, histogram)] = reward_histograms(dist)
    assert [bar[4] for bar in histogram.bars] == [
        "[-1e+308, -5e+307)", "[-5e+307, 0)", "[0, 5e+307)", "[5e+307, 1e+308]"]
    plain = reward_distribution([(["1"], 0.0), (["1"], 1.0)], bins=4)
    [(_, histogram)] = reward_histograms(plain)
    assert [bar[4] for bar in histogram.bars] == [
        "[0, 0.25)", "[0.25, 0.5)", "[0.5, 0.75)", "[0.75, 1]"]

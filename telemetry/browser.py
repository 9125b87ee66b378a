"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by Selenium: the
dashboard's screenshot for the docs and its test. Nothing here reaches beyond the given URL."""

from __future__ import annotations

import shutil
import time

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--force-device-scale-factor=1")


def chromium(width: int = 1400, height: int = 1200):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        raise RuntimeError("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in (*CHROMIUM_FLAGS, f"--window-size={width},{height}"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


def open_dashboard(browser, url: str, key: str | None = None, timeout: float = 30.0) -> None:
    """Load ``/dashboard`` and wait until it has drawn the stats once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{url.rstrip('/')}/dashboard" + (f"#key={key}" if key else ""))
    WebDriverWait(browser, timeout).until(lambda b: b.execute_script("return !!window.osdStats"))
    WebDriverWait(browser, timeout).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#acceptance canvas"))
    time.sleep(0.5)  # the canvas paints on the next frame


def main(argv: list[str] | None = None) -> int:
    """``python -m telemetry.browser URL OUT.png [--key K]``: a full-page screenshot of the dashboard."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m telemetry.browser")
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--key", default=None)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1150)
    args = ap.parse_args(argv)
    browser = chromium(args.width, args.height)
    try:
        open_dashboard(browser, args.url, args.key)
        browser.save_screenshot(args.out)
    finally:
        browser.quit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

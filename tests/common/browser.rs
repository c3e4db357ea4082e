//! A real headless Chromium (Debian's `chromium`, which `deploy/local/test` installs), driven
//! over the DevTools protocol by `chromiumoxide`, for the console's tests.
//!
//! The browser is started here rather than by chromiumoxide's launcher so that it runs in a
//! process group of its own: dropping [`Chromium`] kills the whole group (the browser, its
//! zygote, renderers and GPU process) with SIGKILL and reaps the browser, whether the test passed
//! or panicked, and the browser gets SIGKILL too when the test process itself is killed
//! (PR_SET_PDEATHSIG). Its profile is a temporary directory removed with it. It runs with
//! `--no-sandbox` because the tests run as root, where Chromium's sandbox refuses to start.
//! Chromium also starts two crash handlers outside the group, as daemons: they exit by themselves
//! seconds after the browser (`--disable-crashpad-for-testing` keeps them from starting, but with
//! it Chromium 156 never finished opening a tab here).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chromiumoxide::Browser;
use chromiumoxide::Page;
use chromiumoxide::cdp::browser_protocol::emulation::SetDeviceMetricsOverrideParams;
use chromiumoxide::cdp::browser_protocol::page::CaptureScreenshotFormat;
use chromiumoxide::handler::HandlerConfig;
use chromiumoxide::handler::viewport::Viewport;
use chromiumoxide::page::ScreenshotParams;
use futures::StreamExt;

/// The viewport pages open with: a laptop's.
pub const DESKTOP: (u32, u32) = (1280, 900);
/// A phone's viewport (CSS pixels of an iPhone 12 to 15).
pub const PHONE: (u32, u32) = (390, 844);

/// A headless Chromium and the DevTools connection to it. Killed, with every process it
/// started, on drop.
pub struct Chromium {
    pub browser: Browser,
    process: Child,
    handler: tokio::task::JoinHandle<()>,
    _profile: tempfile::TempDir,
}

/// `OUTBOX_CHROMIUM` if set, else `chromium` on the PATH.
fn executable() -> PathBuf {
    if let Some(path) = std::env::var_os("OUTBOX_CHROMIUM") {
        return path.into();
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("chromium"))
        .find(|path| path.is_file())
        .expect("no chromium on the PATH: deploy/local/test installs Debian's (or set OUTBOX_CHROMIUM)")
}

impl Chromium {
    /// Starts Chromium headless on a fresh profile and connects to it; pages open at [`DESKTOP`].
    pub async fn start() -> Chromium {
        let profile = tempfile::tempdir().unwrap();
        let mut command = Command::new(executable());
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-extensions",
                "--disable-sync",
                "--hide-scrollbars",
                "--mute-audio",
                "--remote-debugging-address=127.0.0.1",
                // the browser picks a free port and writes it to DevToolsActivePort
                "--remote-debugging-port=0",
                &format!("--window-size={},{}", DESKTOP.0, DESKTOP.1),
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent. It kills the
        // browser when the test process dies without running Drop (a runner's timeout kills it
        // with SIGKILL; the signal follows the thread that forked: the test's own, which lives as
        // long as the test); the rest of its group exits when it does.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let process = command.spawn().expect("start chromium");
        let mut chromium = ChromiumProcess { process: Some(process) };
        let endpoint = devtools_endpoint(&profile.path().join("DevToolsActivePort"), &mut chromium).await;
        let viewport = Viewport {
            width: DESKTOP.0,
            height: DESKTOP.1,
            device_scale_factor: Some(1.0),
            ..Viewport::default()
        };
        let config = HandlerConfig { viewport: Some(viewport), ..HandlerConfig::default() };
        let (browser, mut handler) = Browser::connect_with_config(endpoint, config)
            .await
            .expect("connect to chromium's DevTools endpoint");
        let handler = tokio::spawn(async move { while handler.next().await.is_some() {} });
        let process = chromium.process.take().unwrap();
        Chromium { browser, process, handler, _profile: profile }
    }

    /// Opens `url` in a new tab once it has loaded (within [`super::IDLE`]: a browser that
    /// never answers fails the test rather than hanging it).
    pub async fn open(&self, url: &str) -> Page {
        match tokio::time::timeout(super::IDLE, self.browser.new_page(url)).await {
            Ok(page) => page.unwrap_or_else(|e| panic!("open {url}: {e}")),
            Err(_) => panic!("chromium did not open {url} within {:?}", super::IDLE),
        }
    }
}

/// The browser process until the DevTools connection is made: killed if the test panics before.
struct ChromiumProcess {
    process: Option<Child>,
}

impl Drop for ChromiumProcess {
    fn drop(&mut self) {
        if let Some(process) = self.process.as_mut() {
            kill_group(process);
        }
    }
}

/// Kills `process`'s group (it leads one: `process_group(0)`) and reaps it.
fn kill_group(process: &mut Child) {
    let group = format!("-{}", process.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
    let _ = process.kill();
    let _ = process.wait();
}

/// Waits (up to 30 s) for Chromium to write its DevTools port and path; returns the endpoint's
/// WebSocket URL.
async fn devtools_endpoint(file: &std::path::Path, chromium: &mut ChromiumProcess) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // the file is written whole once the endpoint listens: port, then path
        if let Ok(text) = std::fs::read_to_string(file)
            && let Some((port, path)) = text.trim().split_once('\n')
        {
            return format!("ws://127.0.0.1:{}{}", port.trim(), path.trim());
        }
        let process = chromium.process.as_mut().unwrap();
        if let Some(status) = process.try_wait().unwrap() {
            panic!("chromium exited ({status}) before it listened for DevTools");
        }
        assert!(Instant::now() < deadline, "chromium did not write {} within 30 s", file.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        self.handler.abort();
        kill_group(&mut self.process);
    }
}

/// Resizes `page`'s viewport to `size` (`mobile`: a phone's, with touch and a mobile viewport
/// meta honoured) and takes a PNG of what shows.
pub async fn screenshot(page: &Page, size: (u32, u32), mobile: bool) -> Vec<u8> {
    let scale = if mobile { 2.0 } else { 1.0 };
    let metrics = SetDeviceMetricsOverrideParams::new(size.0 as i64, size.1 as i64, scale, mobile);
    page.execute(metrics).await.expect("resize the viewport");
    let params = ScreenshotParams::builder().format(CaptureScreenshotFormat::Png).build();
    page.screenshot(params).await.expect("take a screenshot")
}

/// The value of the JavaScript expression `expression` on `page`; None if it throws or is not a `T`.
pub async fn read<T: serde::de::DeserializeOwned>(page: &Page, expression: &str) -> Option<T> {
    page.evaluate(expression).await.ok()?.into_value().ok()
}

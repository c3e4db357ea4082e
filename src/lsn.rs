//! `Lsn`: a PostgreSQL WAL position. The only place LSN arithmetic happens.

use std::fmt;
use std::str::FromStr;

/// A WAL position, printed the way PostgreSQL prints `pg_lsn` (`16/B374D848`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    /// Bytes of WAL from `earlier` to `self`; zero when `earlier` is ahead.
    pub fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl FromStr for Lsn {
    type Err = String;

    fn from_str(s: &str) -> Result<Lsn, String> {
        let (hi, lo) = s.split_once('/').ok_or_else(|| format!("\"{s}\" is not an LSN (X/Y)"))?;
        let hi = u64::from_str_radix(hi, 16).map_err(|e| format!("\"{s}\" is not an LSN: {e}"))?;
        let lo = u64::from_str_radix(lo, 16).map_err(|e| format!("\"{s}\" is not an LSN: {e}"))?;
        if hi > u64::from(u32::MAX) || lo > u64::from(u32::MAX) {
            return Err(format!("\"{s}\" is not an LSN: a half exceeds 32 bits"));
        }
        Ok(Lsn((hi << 32) | lo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_and_parses_like_postgres() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn.0, 0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert!("16".parse::<Lsn>().is_err());
        assert!("1FFFFFFFF/0".parse::<Lsn>().is_err());
    }

    #[test]
    fn distance_saturates() {
        assert_eq!(Lsn(100).bytes_since(Lsn(40)), 60);
        assert_eq!(Lsn(40).bytes_since(Lsn(100)), 0);
    }
}

//! TEMPORARY stub so the runtime compiles until the real module lands.
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActionKind {
    F,
    B,
    I,
    W,
}
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Action {
    pub stage: usize,
    pub kind: ActionKind,
    pub mb: usize,
}
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}{}", self.stage, self.kind, self.mb)
    }
}
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    GPipe,
    OneFOneB,
    Interleaved1F1B,
    ZbH1,
}
impl std::str::FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpipe" => Ok(Self::GPipe),
            "1f1b" => Ok(Self::OneFOneB),
            "interleaved" => Ok(Self::Interleaved1F1B),
            "zb-h1" => Ok(Self::ZbH1),
            _ => Err(format!("unknown {s}")),
        }
    }
}
#[derive(Clone, Debug)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub ranks: usize,
    pub chunks: usize,
    pub microbatches: usize,
    pub actions: Vec<Vec<Action>>,
}
#[derive(Debug)]
pub struct ScheduleError(String);
impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
pub struct Costs;
impl Costs {
    pub fn unit() -> Costs {
        Costs
    }
}
impl Schedule {
    pub fn validate(&self) -> Result<(), ScheduleError> {
        Ok(())
    }
    pub fn simulate(&self, _c: &Costs) -> Result<(), ScheduleError> {
        Ok(())
    }
}
pub fn build(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<Schedule, ScheduleError> {
    let mut actions = vec![];
    for r in 0..p {
        let mut a = vec![];
        let f = |mb| Action { stage: r, kind: ActionKind::F, mb };
        let b = |mb| Action { stage: r, kind: ActionKind::B, mb };
        match kind {
            ScheduleKind::GPipe => {
                for mb in 0..m {
                    a.push(f(mb));
                }
                for mb in 0..m {
                    a.push(b(mb));
                }
            }
            _ => {
                let w = (p - r - 1).min(m);
                for mb in 0..w {
                    a.push(f(mb));
                }
                for mb in w..m {
                    a.push(f(mb));
                    a.push(b(mb - w));
                }
                for mb in (m - w)..m {
                    a.push(b(mb));
                }
            }
        }
        actions.push(a);
    }
    Ok(Schedule { kind, ranks: p, chunks: v, microbatches: m, actions })
}
